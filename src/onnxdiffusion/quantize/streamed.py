"""ORT's quantizers on a skeleton (a backbone past the inline limit, onnxio/files.py): its weights read one at a
time from their file and the quantized ones written to a spill file as they are made, so neither the fp32 model nor
its quantized copy is ever held whole (the FLUX.2 [klein] backbone is 15.5 GB of fp32 weights, Z-Image's 24.6 GB).

ORT's quantizer wants a ModelProto: it gets the skeleton, whose large initializers keep their external-data
references. Inside `spilled` (a lock held; nothing else quantizes meanwhile) ORT's readers are swapped:
`tensor_proto_to_array` (ONNXQuantizer's, QDQQuantizer's) and onnx's `to_array` in its Gemm transposition, so an
external weight is read from its file without its bytes being kept in the tensor (onnx's reader caches them there);
and its writers: the model's `initializer_extend` / `add_initializer` and the Gemm transposition's `from_array`, so
each tensor it makes over SPILL_FROM bytes goes to the spill file before it reaches the graph (bytes once in the
graph's protobuf arena stay allocated with the graph, cleared or not) and stays there as a reference; ORT's
save-and-reload for shape inference becomes shape inference on the skeleton. At the end the float
weights the quantizer left (biases, norms, the linears kept in float) are copied beside the quantized ones, one at a
time, and the result is a skeleton of the spill folder (removed with the run's temporary files; `files.save` writes
it into the model folder tensor by tensor). Same integers, scales and graph as the in-memory path
(tests/quantize/test_quantize_files.py, test_quantize_external.py); peak RSS flat in the model's size
(experiments/families/quantize_streamed.md)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import onnx
from onnx import TensorProto

from ..folder import tempfiles
from ..onnxio.aligned import AlignedData
from ..onnxio.files import (DATA_DIR_KEY, SPILL_PREFIX, all_graphs, copy, data_dir, infer_shapes,
                            read_tensor, tensor_array)

SPILL_NAME = "weights.bin"
SPILL_FROM = 1024  # bytes: what files.write_external would move out of the graph anyway
_PATCHING = threading.Lock()


class Spill:
    """One data file, written in order; each tensor page-aligned (ORT maps them)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.file = open(self.folder / SPILL_NAME, "wb")
        self.data = AlignedData(self.file, SPILL_NAME)

    def put(self, tensor: TensorProto, data: bytes) -> None:
        self.data.put(tensor, data)

    def take(self, tensor: TensorProto) -> TensorProto:
        """`tensor` with its bytes moved here when they are over SPILL_FROM (raw_data only: what ORT writes)."""
        if tensor.data_location != TensorProto.EXTERNAL and len(tensor.raw_data) > SPILL_FROM:
            self.put(tensor, tensor.raw_data)
        return tensor

    def close(self) -> None:
        self.file.close()


@contextlib.contextmanager
def spilled(model: onnx.ModelProto):
    """Inside the block ORT's quantizers read `model`'s (a skeleton's) external weights from its folder, one at a
    time; yields (the spill, a function that hooks an ORT ONNXModel's initializer adders onto the spill)."""
    from types import SimpleNamespace

    from onnxruntime.quantization import base_quantizer, onnx_model, onnx_quantizer, qdq_quantizer, quant_utils

    folder = data_dir(model)
    if folder is None:
        raise ValueError("spilled(): not a skeleton")
    spill = Spill(tempfiles.mkdtemp(SPILL_PREFIX))
    original = quant_utils.tensor_proto_to_array

    def values(tensor: TensorProto):
        if tensor.data_location != TensorProto.EXTERNAL:
            return onnx.numpy_helper.to_array(tensor)
        if _location(tensor) == SPILL_NAME:  # a tensor the quantizer made (a Gemm's transposed weight)
            spill.file.flush()
            return tensor_array(tensor, spill.folder)
        return tensor_array(tensor, folder)

    def read(tensor: TensorProto):
        if tensor.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            return original(tensor)  # ORT's own "only float" error
        return values(tensor)

    def hook(ort_model) -> None:
        """After the quantizer's constructor: each large tensor it adds from now on spilled before it is added."""
        extend, add = ort_model.initializer_extend, ort_model.add_initializer
        ort_model.initializer_extend = lambda inits: extend([spill.take(t) for t in inits])
        ort_model.add_initializer = lambda tensor: add(spill.take(tensor))

    def reinferred(m: onnx.ModelProto) -> onnx.ModelProto:
        # ORT's version saves the model and loads it back whole to infer shapes (after transposing Gemm weights)
        out = infer_shapes(copy(m))
        quant_utils.add_infer_metadata(out)
        return out

    modules = (quant_utils, base_quantizer, onnx_quantizer, qdq_quantizer)
    helper, reload = onnx_model.onnx_numpy_helper, onnx_quantizer.save_and_reload_model_with_shape_infer
    with _PATCHING:
        for m in modules:
            m.tensor_proto_to_array = read
        # a tensor ORT makes straight into the graph (a Gemm's transposed weight) is spilled before it gets there:
        # bytes once in the graph's protobuf arena stay allocated with the graph, cleared or not
        onnx_model.onnx_numpy_helper = SimpleNamespace(
            to_array=lambda t, base_dir="": values(t),
            from_array=lambda a, name=None: spill.take(onnx.numpy_helper.from_array(a, name)))
        onnx_quantizer.save_and_reload_model_with_shape_infer = reinferred
        try:
            yield spill, hook
        except BaseException:
            spill.close()
            tempfiles.remove(spill.folder)
            raise
        finally:
            for m in modules:
                m.tensor_proto_to_array = original
            onnx_model.onnx_numpy_helper = helper
            onnx_quantizer.save_and_reload_model_with_shape_infer = reload


def finish(result: onnx.ModelProto, spill: Spill, source: Path) -> onnx.ModelProto:
    """`result` as a skeleton of the spill folder: the weights still read from `source` copied in, one at a time."""
    for g in all_graphs(result.graph):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL and _location(t) != SPILL_NAME:
                spill.put(t, read_tensor(t, source).raw_data)
    spill.close()
    kept = [p for p in result.metadata_props if p.key != DATA_DIR_KEY]
    del result.metadata_props[:]
    result.metadata_props.extend(kept)
    result.metadata_props.add(key=DATA_DIR_KEY, value=str(spill.folder))
    return result


def spill_folders(models) -> list[Path]:
    """The spill folders the given models read their weights from (removed once they are saved)."""
    return [d for m in models if (d := data_dir(m)) is not None and d.name.startswith(SPILL_PREFIX)]


def _location(t: TensorProto) -> str | None:
    return next((e.value for e in t.external_data if e.key == "location"), None)


def dynamic_quantize(model: onnx.ModelProto, nodes, op_types, weight_type, per_channel: bool) -> onnx.ModelProto:
    """ORT's quantize_dynamic, step for step, on a skeleton: shape inference (on the skeleton), the opset update,
    ONNXQuantizer in IntegerOps mode, the topological sort its save does; weights streamed (module doc)."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, QuantType, add_infer_metadata, update_opset_version

    source = data_dir(model)
    work = infer_shapes(copy(model))
    add_infer_metadata(work)
    work = update_opset_version(work, weight_type)
    with spilled(work) as (spill, hook):
        quantizer = ONNXQuantizer(work, per_channel, False, QuantizationMode.IntegerOps, False, weight_type,
                                  QuantType.QUInt8, None, list(nodes), [], list(op_types), {"MatMulConstBOnly": True})
        del work  # the quantizer holds its own (shape-inferred) copy
        hook(quantizer.model)
        quantizer.quantize_model()
        quantizer.model.topological_sort()
        return finish(quantizer.model.model, spill, source)
