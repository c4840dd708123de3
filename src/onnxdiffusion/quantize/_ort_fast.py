"""Speed-ups of ONNX Runtime's QDQ quantizer (quantize/_ort.py's qdq_quantize) that leave its output byte for byte
as ORT writes it (tests/quantize/test_quantize_adapter.py; bench/behaviour_hashes.py: 62 recipe x model cases).

Measured on the shipped UNet (int8-static, 8 x 10 calibration, 1 thread, AMD EPYC Zen 4, two interleaved rounds): the
eight quantizer builds of its plan search 7.4 / 8.1 -> 3.9 / 3.2 CPU s, the whole quantize 16.8 / 18.1 -> 14.1 / 12.3."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading

import numpy as np
import onnx

_PATCHING = threading.Lock()
_CHANNEL_PARAMS: dict = {}  # (channel digest, arguments) -> (zero point, scale)
_CHANNEL_PARAMS_MAX = 1 << 16  # ~25 MB; the shipped UNet has ~10 k weight channels
_QUANTIZED: dict = {}  # (weight digest, arguments) -> quantized initializer
_QUANTIZED_MAX_BYTES = 64 << 20
_QUANTIZED_BYTES = [0]


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _remembered_params(compute):
    def remembered(data, quant_type, symmetric, reduce_range=False, min_real_range=None, rmin_override=None,
                   rmax_override=None):
        key = (_digest(data.tobytes()), data.dtype.str, data.shape, quant_type, symmetric, reduce_range,
               min_real_range, rmin_override, rmax_override)
        params = _CHANNEL_PARAMS.get(key)
        if params is None:
            params = compute(data, quant_type, symmetric, reduce_range, min_real_range, rmin_override, rmax_override)
            if len(_CHANNEL_PARAMS) >= _CHANNEL_PARAMS_MAX:
                _CHANNEL_PARAMS.clear()
            _CHANNEL_PARAMS[key] = params
        return tuple(np.copy(a) for a in params)

    return remembered


def _remembered_weights(quantize):
    def remembered(weight, quant_type, zero_point, scale, axis=None, quant_weight_name=None, **kwargs):
        if weight.data_location == onnx.TensorProto.EXTERNAL or not weight.raw_data:
            return quantize(weight, quant_type, zero_point, scale, axis, quant_weight_name, **kwargs)
        key = (weight.name, _digest(weight.raw_data), weight.data_type, tuple(weight.dims), quant_type,
               zero_point.dtype.str, zero_point.tobytes(), scale.dtype.str, scale.tobytes(), axis, quant_weight_name,
               tuple(sorted(kwargs.items())))
        if key not in _QUANTIZED:
            q = quantize(weight, quant_type, zero_point, scale, axis, quant_weight_name, **kwargs)
            if _QUANTIZED_BYTES[0] + len(q.raw_data) > _QUANTIZED_MAX_BYTES:
                _QUANTIZED.clear()
                _QUANTIZED_BYTES[0] = 0
            _QUANTIZED[key] = q
            _QUANTIZED_BYTES[0] += len(q.raw_data)
        out = onnx.TensorProto()
        out.CopyFrom(_QUANTIZED[key])
        return out

    return remembered


def _first_by_name(item_name, item_list):
    for item in item_list:  # ORT's find_by_name builds the list of every match to return the first
        if item.name == item_name:
            return item
    return None


@contextlib.contextmanager
def weights_remembered():
    """ORT's QDQ quantizer computes each weight channel's scale and integers in Python calls per channel (81 k
    calls, 6 of the 21 s a profiled int8-static quantize of the shipped UNet took), and int8-static's plan search
    quantizes the same weights in up to four builds. Inside this block the quantizer takes a channel's scale, and a weight's integers,
    that it has computed before (same bytes, same arguments) from a table: the same values, computed once per
    process. Its initializer lookups stop at the first match (ORT lists every match to return the first)."""
    from onnxruntime.quantization import qdq_quantizer as qq

    patches = {"compute_data_quant_params": _remembered_params, "quantize_onnx_initializer": _remembered_weights,
               "find_by_name": lambda _: _first_by_name}
    with _PATCHING:
        originals = {name: getattr(qq, name) for name in patches}
        for name, make in patches.items():
            setattr(qq, name, make(originals[name]))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(qq, name, original)


@functools.cache
def consumer_indexed_model() -> type:
    """ORT's ONNXModel with a consumer index behind `replace_input_of_all_nodes`.

    ORT's version rescans every node in Python for each tensor it gives a Q/DQ pair: nodes x tensors (on the
    shipped UNet 1.9 M node visits, 3.8 of the 21 s a profiled int8-static quantize took). The index maps a tensor to
    the positions of the nodes reading it; nodes appended since the last call are indexed on the next one, and
    any other input edit or node removal through the model's methods drops it (rebuilt on next use), so the
    graph written is the one ORT's scan writes (tests/quantize/test_behaviour_hashes.py, tests/quantize/test_quantize_files.py)."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    class ConsumerIndexedModel(ONNXModel):
        _index: dict | None = None
        _indexed = 0

        def _consumers(self) -> dict[str, list[int]]:
            nodes = self.model.graph.node
            if self._index is None or len(nodes) < self._indexed:
                self._index, self._indexed = {}, 0
            for i in range(self._indexed, len(nodes)):
                for name in nodes[i].input:
                    self._index.setdefault(name, []).append(i)
            self._indexed = len(nodes)
            return self._index

        def replace_input_of_all_nodes(self, old_input_name, new_input_name):
            index = self._consumers()
            nodes = self.model.graph.node
            moved = []
            for i in dict.fromkeys(index.pop(old_input_name, ())):
                if old_input_name in nodes[i].input:
                    ONNXModel.replace_node_input(nodes[i], old_input_name, new_input_name)
                    moved.append(i)
            index.setdefault(new_input_name, []).extend(moved)

        def replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set):
            self._index = None
            super().replace_input_of_nodes(old_input_name, new_input_name, node_names_set)

        def replace_node_input(self, node, old_input_name, new_input_name):  # ORT: a staticmethod called on the model
            self._index = None
            ONNXModel.replace_node_input(node, old_input_name, new_input_name)

        def remove_node(self, node):
            self._index = None
            super().remove_node(node)

    return ConsumerIndexedModel
