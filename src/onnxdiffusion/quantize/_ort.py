"""The one adapter to ONNX Runtime's quantization and float16 tools.

Nothing else in onnxdiffusion imports ``onnxruntime.quantization`` (or
``onnxruntime.transformers.float16``) but _ort_fast.py, this adapter's speed-ups of ORT's QDQ quantizer:
their string-keyed ``extra_options`` dicts, enum types and file-path calling conventions stay behind
the typed functions below, which take and return ``onnx.ModelProto``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx

from . import files
from ._ort_fast import consumer_indexed_model, weights_remembered

Range = tuple[float, float]


def _quiet() -> None:
    # ORT's quantizer logs "please run pre-processing" warnings through the root logger
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    # the weight-only quantizer's module logger is set to INFO (a line per weight)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)


def _qtype(name: str):
    from onnxruntime.quantization import QuantType

    return {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}[name]


def qdq_quantize(model: onnx.ModelProto, ranges: dict[str, Range], nodes: Sequence[str], op_types: Sequence[str],
                 activation_type: str = "uint8", float_outputs: Sequence[str] = (), owned: bool = False) -> onnx.ModelProto:
    """Static QDQ: per-channel symmetric int8 weights, activations with the given ranges.

    `model` must carry shape information (``onnx.shape_inference.infer_shapes``); only the
    named nodes are quantized and only `op_types` are considered (a restricted op list is what
    makes ORT honour node selection). Outputs of `float_outputs` op types get no Q/DQ pair: ORT
    then runs DQ->MatMul as MatMulIntegerToFloat (int8 in, float out).
    """
    from onnxruntime.quantization.calibrate import TensorData

    _quiet()
    data = {k: TensorData(lowest=np.array(lo, np.float32), highest=np.array(hi, np.float32)) for k, (lo, hi) in ranges.items()}
    # `owned`: the caller hands `model` over (no copy); a skeleton's weights are streamed (quantize/streamed.py)
    work = model if owned and files.data_dir(model) is None else files.copy(model)
    if len(work.graph.value_info) and not any(p.key == "onnx.infer" for p in work.metadata_props):
        # already shape-inferred (recipes.prepare_unet): without ORT's marker its quantizer deep-copies
        # the model, saves it and loads it back to infer shapes again (two more copies of the weights;
        # at SD1.5 size that took the quantizer past 10 GB)
        work.metadata_props.add(key="onnx.infer", value="onnxruntime.quant")
    if files.data_dir(work) is not None:
        from .streamed import finish, spilled

        with spilled(work) as (spill, hook):
            quantizer = _qdq_quantizer(work, data, nodes, op_types, activation_type, float_outputs)
            hook(quantizer.model)
            with weights_remembered():
                quantizer.quantize_model()
            return finish(quantizer.model.model, spill, files.data_dir(work))
    quantizer = _qdq_quantizer(work, data, nodes, op_types, activation_type, float_outputs)
    with weights_remembered():
        quantizer.quantize_model()
    return quantizer.model.model


def _qdq_quantizer(work: onnx.ModelProto, data: dict, nodes, op_types, activation_type: str, float_outputs):
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    quantizer = QDQQuantizer(
        work,
        True,  # per_channel
        False,  # reduce_range
        _qtype("int8"),
        _qtype(activation_type),
        TensorsData(CalibrationMethod.MinMax, data),
        list(nodes),
        [],
        list(op_types),
        {"WeightSymmetric": True, "ActivationSymmetric": False,
         "OpTypesToExcludeOutputQuantization": list(float_outputs)},
    )
    quantizer.model.__class__ = consumer_indexed_model()
    return quantizer


def dynamic_quantize(model: onnx.ModelProto, nodes: Sequence[str], op_types: Sequence[str], weight_type: str,
                     per_channel: bool) -> onnx.ModelProto:
    from onnxruntime.quantization import quantize_dynamic

    _quiet()
    if files.data_dir(model) is not None:  # a skeleton: weights streamed, never the whole model in memory
        from .streamed import dynamic_quantize as streamed

        return streamed(model, nodes, op_types, _qtype(weight_type), per_channel)
    large = files.is_large(model)
    with files.as_file(model, "in.onnx") as src, tempfile.TemporaryDirectory(prefix="onnxdiffusion-dyn-") as tmp:
        dst = Path(tmp) / "out.onnx"
        quantize_dynamic(src, dst, op_types_to_quantize=list(op_types), per_channel=per_channel, reduce_range=False,
                         weight_type=_qtype(weight_type), nodes_to_quantize=list(nodes), use_external_data_format=large,
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(dst))


def _weight_quantizer(algorithm: str, block_size: int, symmetric: bool, accuracy_level: int, bits: int):
    """ORT's per-node weight-only quantizer for `algorithm`; its `.quantize(node, [graph])` takes the weight from
    the graph's initializers and puts the quantized ones there.

    default: ORT's blockwise min/max round-to-nearest (C++; `symmetric` as given), numpy only.
    hqq: ORT's Half-Quadratic Quantization (a proximal solver for each block's float zero point; asymmetric,
    `symmetric` ignored); needs torch, imported here at quantize time only: the MatMulNBits it writes (float
    zero points) run on ONNX Runtime alone. gptq: see gptq_int4_quantize (whole model, not per node).
    Not offered: ORT 1.32's vendored k-quant (`rtn_quantize`) packs 4-bit zero points wrongly when a weight has
    an odd number of blocks per column (MMDiT: K=160, block 32 -> reshape error)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    if algorithm == "default":
        return nbits.DefaultWeightOnlyQuantizer(nbits.DefaultWeightOnlyQuantConfig(
            block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level or None,
            op_types_to_quantize=("MatMul",), bits=bits))
    if algorithm == "hqq":
        try:
            import torch  # noqa: F401
        except ImportError:
            from ..errors import UserError

            raise UserError("int4-weights algorithm=hqq needs torch at quantize time (pip install 'onnxdiffusion[export]')") from None
        return _Hqq(nbits.HQQWeightOnlyQuantizer(nbits.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)),
                    accuracy_level)
    raise ValueError(f"unknown 4-bit algorithm {algorithm!r}")


class _Hqq:
    """HQQ's per-node quantizer with the accuracy level set (ORT's HQQ writes none)."""

    def __init__(self, quantizer, accuracy_level: int):
        self.quantizer, self.accuracy_level = quantizer, accuracy_level

    def quantize(self, node, graph_stack):
        made = self.quantizer.quantize(node, graph_stack)
        for n in made:
            if n.op_type == "MatMulNBits" and self.accuracy_level:
                n.attribute.append(onnx.helper.make_attribute("accuracy_level", self.accuracy_level))
        return made


def int4_quantize(model: onnx.ModelProto, nodes: Sequence[str], block_size: int, symmetric: bool,
                  accuracy_level: int, bits: int = 4, algorithm: str = "default", quantizer=None) -> onnx.ModelProto:
    """The named MatMuls' weights to `bits`-bit (4 or 8) blocks: MatMul -> com.microsoft.MatMulNBits; other MatMuls untouched.

    Tensor by tensor with ORT's own blockwise quantizer (DefaultWeightOnlyQuantizer, what its
    MatMulNBitsQuantizer runs per node): each weight is read alone (through files.array, so a > 2 GB
    skeleton stays a skeleton, its other weights left in their file), quantized, and dropped once no
    node reads it. ORT's whole-model quantizer held the full-size UNet in memory several times over
    (10.6 GB at SD1.5 size). `quantizer`: a per-node quantizer made elsewhere (gptq.weight_quantizer), in
    place of `algorithm`'s."""
    from onnx import numpy_helper

    _quiet()
    quantizer = quantizer or _weight_quantizer(algorithm, block_size, symmetric, accuracy_level, bits)
    work = files.copy(model)  # a skeleton's copy holds no weights; an in-memory model's copy is what we return
    g = work.graph
    wanted = set(nodes)
    inits = {t.name: t for t in g.initializer}
    shapes = {v.name: v for v in list(g.input) + list(g.value_info) + list(g.output)}
    out_nodes, replaced = [], set()
    for node in g.node:
        if node.op_type != "MatMul" or node.name not in wanted or node.input[1] not in inits:
            out_nodes.append(node)
            continue
        # a one-tensor graph for ORT's per-node quantizer: the weight, read alone, and A's shape (its rank
        # decides whether MatMulNBits needs an output Reshape)
        holder = onnx.GraphProto()
        holder.initializer.append(numpy_helper.from_array(files.array(work, inits[node.input[1]]), node.input[1]))
        if node.input[0] in shapes:
            holder.value_info.append(shapes[node.input[0]])
        made = quantizer.quantize(node, [holder])
        if len(made) == 1 and made[0] is node:  # not a 2-D (or unit-batched) weight: left as it was
            out_nodes.append(node)
            continue
        out_nodes.extend(made)
        g.initializer.extend(t for t in holder.initializer if t.name != node.input[1])
        replaced.add(node.input[1])
    del g.node[:]
    g.node.extend(out_nodes)
    used = {x for sub in files.all_graphs(g) for node in sub.node for x in node.input} | {o.name for o in g.output}
    dead = {name for name in replaced if name not in used}
    kept = [t for t in g.initializer if t.name not in dead]
    del g.initializer[:]
    g.initializer.extend(kept)
    kept_inputs = [i for i in g.input if i.name not in dead]
    del g.input[:]
    g.input.extend(kept_inputs)
    if replaced:
        ms = [o for o in work.opset_import if o.domain == "com.microsoft"]
        if ms:
            ms[0].version = 1
        else:
            work.opset_import.add(domain="com.microsoft", version=1)
    return work


def gptq_int4_quantize(model: onnx.ModelProto, nodes: Sequence[str], block_size: int, accuracy_level: int,
                       feeds: Iterable[dict]) -> onnx.ModelProto:
    """The named MatMuls' weights to 4-bit symmetric blocks by GPTQ (ORT's vendored Intel Neural Compressor
    `gptq_quantize`): each weight's rounding error is pushed onto the weights not yet rounded, weighted by
    the Hessian of its input activations, accumulated over `feeds` (backbone feeds from the calibration
    trajectories). numpy only. The whole model runs once per MatMul input for the Hessians, so this path
    takes an in-memory model (< 2 GB); symmetric only: ORT 1.32's INC code packs asymmetric 4-bit zero
    points wrongly when a weight has an odd number of blocks per column."""
    from onnxruntime.quantization.neural_compressor.weight_only import gptq_quantize

    from ..errors import UserError

    if files.is_large(model):
        raise UserError("int4-weights algorithm=gptq runs the whole backbone for its Hessians: only backbones under 2 GB")
    _quiet()
    wanted = set(nodes)
    config: dict = {n.name: ({"bits": 4, "group_size": block_size, "scheme": "sym", "algorithm": "GPTQ"}
                             if n.name in wanted else "fp32") for n in model.graph.node if n.op_type == "MatMul"}
    work = onnx.ModelProto()
    work.CopyFrom(model)
    loader = [(dict(feed), None) for feed in feeds]
    with contextlib.redirect_stdout(io.StringIO()):  # its progress bar
        done = gptq_quantize(work, loader, weight_config=config, num_bits=4, group_size=block_size, scheme="sym",
                             n_samples=-1, accuracy_level=accuracy_level).model
    if not any(o.domain == "com.microsoft" for o in done.opset_import):
        done.opset_import.add(domain="com.microsoft", version=1)
    _new_initializers_by_name(done, {t.name for t in model.graph.initializer})
    return done


def _new_initializers_by_name(model: onnx.ModelProto, before: set[str]) -> None:
    """The initializers a quantizer added, after the kept ones, in name order.

    INC's gptq_quantize walks the MatMul inputs through `list(set(...))`, so the packed weights it adds
    come in the interpreter's string-hash order (PYTHONHASHSEED): the same numbers written in another
    order each run. The kept ones stay in their order."""
    position = {t.name: i for i, t in enumerate(model.graph.initializer)}
    model.graph.initializer.sort(key=lambda t: (0, position[t.name], "") if t.name in before else (1, 0, t.name))


def fp16_convert(model: onnx.ModelProto, op_block_list: Iterable[str] = ()) -> onnx.ModelProto:
    """float16 weights and compute with float32 graph inputs and outputs."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    _quiet()
    blocked = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(op_block_list))
    # with shape inference the converter keeps Resize's scales float32 (without it the VAE decoder breaks)
    for disable_shape_infer in (False, True):
        work = files.weights_copy(model)
        try:
            return convert_float_to_float16(work, keep_io_types=True, op_block_list=blocked,
                                            disable_shape_infer=disable_shape_infer)
        except Exception:  # noqa: BLE001 - ONNX shape inference can fail on exotic graphs; retry without
            if disable_shape_infer:
                raise
    raise AssertionError("unreachable")


def histogram_thresholds(histograms: dict[str, tuple], method: str, num_bins: int, percentile: float) -> dict[str, Range]:
    """Entropy or percentile ranges by ORT's histogram calibrator's own threshold search, on histograms
    collected elsewhere (calibration.histogram_ranges streams them batch by batch).

    `histograms`: tensor -> (counts, edges (bins + 1), min, max), over [-m, m] for entropy and of |x|
    over [0, m] for percentile (m = max |x|), as ORT's collector builds them. `num_bins` is explicit:
    with ORT's default (128 bins, 128 quantized bins) the entropy search has nothing to choose from
    and returns exactly the min/max range.
    """
    from onnxruntime.quantization.calibrate import HistogramCollector

    _quiet()
    if method == "entropy":
        collector = HistogramCollector("entropy", False, num_bins, 128, percentile, "same")
    elif method == "percentile":
        collector = HistogramCollector("percentile", True, num_bins, 128, percentile, "same")
    else:
        raise ValueError(f"unknown histogram method {method!r}")
    for name, (counts, edges, lo, hi) in histograms.items():
        lo, hi = np.array(lo, np.float32), np.array(hi, np.float32)
        entry = (np.asarray(counts).round().astype(np.int64), np.asarray(edges, np.float32), lo, hi)
        collector.histogram_dict[name] = entry + ((np.array(edges[-1], np.float32),) if method == "entropy" else ())
    with contextlib.redirect_stdout(io.StringIO()):  # the collector prints its progress
        found = collector.compute_collection_result()
    return {name: (float(v[0]), float(v[1])) for name, v in found.items()}


def version() -> str:
    import onnxruntime

    return onnxruntime.__version__
