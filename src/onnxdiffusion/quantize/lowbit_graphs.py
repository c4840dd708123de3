"""FP8 and NVFP4 backbones as ONNX graphs: portable QDQ, TensorRT's form, and the fp32 simulation.

Three graphs come out of one plan (which nodes, which activation scales):

- portable: standard ONNX Q/DQ. FP8 weights (FLOAT8E4M3FN, per output channel) and activations
  (per tensor) at opset 19+; NVFP4 weights as FLOAT4E2M1 with two DequantizeLinear nodes (the E4M3
  block scales times the float32 tensor scale, then the values with `block_size` 16 along the
  input dimension), opset 23. Passes `onnx.checker.check_model(full_check=True)`.
- tensorrt: what NVIDIA Model Optimizer exports and TensorRT parses: weights in the Linear layout
  (out, in) with the two DQs along axis -1 and a Transpose into the MatMul; dynamically quantized
  FP4 activations as `trt::TRT_FP4DynamicQuantize` (outputs FLOAT4E2M1 values and FLOAT8E4M3FN
  block scales) followed by two `trt::DequantizeLinear`; default opset 23; the trt ops' output
  types written into value_info (ONNX cannot infer them).
- simulation: an fp32 graph whose weights are the numpy twin's dequantized values and whose
  activations keep their FP8 Q/DQ (ONNX Runtime's CPU provider runs FP8 Q/DQ but has no FLOAT4E2M1
  kernel): it computes what the portable graph computes (tests check that with ReferenceEvaluator).

Pure onnx + numpy; nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import UserError
from ..onnxio.files import copy as copy_model
from . import lowbit as L

TRT_DOMAIN = "trt"
FP4_OPSET = 23  # the first opset whose Q/DQ take FLOAT4E2M1
FP8_MIN_OPSET = 19


@dataclass(frozen=True)
class WeightLayout:
    """Where a node's weight keeps its output channels and its input (reduction) dimension."""

    out_axis: int
    in_axis: int


def weight_layout(node: onnx.NodeProto, ndim: int) -> WeightLayout:
    if node.op_type == "MatMul":  # (K, N)
        return WeightLayout(ndim - 1, ndim - 2)
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return WeightLayout(0, 1) if trans_b else WeightLayout(1, 0)
    if node.op_type == "Conv":  # (O, I/groups, kh, kw)
        return WeightLayout(0, 1)
    raise ValueError(f"no weight layout for {node.op_type}")


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The default domain raised to `opset` by ONNX's version converter (other domains untouched)."""
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if current >= opset:
        return model
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, opset)
    except Exception as e:  # noqa: BLE001 - the converter raises bare RuntimeErrors
        raise UserError(f"cannot raise the backbone from opset {current} to {opset}: {str(e).splitlines()[0][:200]}") from None


def _fp8_zero(name: str) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, [], [0])


def _scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, np.float32), name)


def fp8_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """A FLOAT8E4M3FN initializer from float32 values already on the grid."""
    import ml_dtypes  # onnx's own dependency for its low-bit types

    return numpy_helper.from_array(np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn), name)


def fp4_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """A FLOAT4E2M1 initializer (two values a byte) from float32 values already on the grid."""
    import ml_dtypes

    return numpy_helper.from_array(np.asarray(values, np.float32).astype(ml_dtypes.float4_e2m1fn), name)


class _Editor:
    """Collects new nodes and initializers; splices them in front of their readers at the end."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.inits = {t.name: t for t in model.graph.initializer}
        self.before: dict[str, list[onnx.NodeProto]] = {}  # node name -> nodes to place before it
        self.new_inits: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.drop: set[str] = set()
        self.act_cache: dict[tuple[str, str], str] = {}  # (tensor, kind) -> its rounded twin

    def add(self, at: str, *nodes: onnx.NodeProto) -> None:
        self.before.setdefault(at, []).extend(nodes)

    def init(self, t: onnx.TensorProto) -> str:
        self.new_inits.append(t)
        return t.name

    def typed(self, name: str, elem: int) -> None:
        self.value_info.append(helper.make_tensor_value_info(name, elem, None))

    def finish(self) -> onnx.ModelProto:
        g = self.model.graph
        nodes = []
        for n in g.node:
            nodes.extend(self.before.get(n.name, []))
            nodes.append(n)
        del g.node[:]
        g.node.extend(nodes)
        keep = [t for t in g.initializer if t.name not in self.drop]
        del g.initializer[:]
        g.initializer.extend(keep + self.new_inits)
        g.value_info.extend(self.value_info)
        return self.model


def _chosen(model: onnx.ModelProto, nodes: list[str]) -> list[onnx.NodeProto]:
    wanted = set(nodes)
    return [n for n in model.graph.node if n.name in wanted]


def _weight_users(model: onnx.ModelProto) -> dict[str, int]:
    users: dict[str, int] = {}
    for n in model.graph.node:
        for x in n.input:
            users[x] = users.get(x, 0) + 1
    return users


# --- activations -----------------------------------------------------------------------------

def _fp8_activation(ed: _Editor, node: onnx.NodeProto, amax: float) -> None:
    """Q/DQ FP8 (per tensor) on the node's data input; one pair per tensor, shared by its readers."""
    x, key = node.input[0], (node.input[0], "fp8")
    if key not in ed.act_cache:
        s = ed.init(_scalar(f"{x}_fp8_scale", float(L.fp8_scale(amax))))
        z = ed.init(_fp8_zero(f"{x}_fp8_zero"))
        q, dq = f"{x}_fp8", f"{x}_fp8_dq"
        ed.add(node.name, helper.make_node("QuantizeLinear", [x, s, z], [q], name=f"{x}_QuantizeLinear"),
               helper.make_node("DequantizeLinear", [q, s, z], [dq], name=f"{x}_DequantizeLinear"))
        ed.act_cache[key] = dq
    node.input[0] = ed.act_cache[key]


def _fp16_activation(ed: _Editor, node: onnx.NodeProto) -> None:
    """Round the node's data input to float16 and back (simulates 16-bit activations in fp32)."""
    x, key = node.input[0], (node.input[0], "fp16")
    if key not in ed.act_cache:
        h, f = f"{x}_f16", f"{x}_f16_f32"
        ed.add(node.name, helper.make_node("Cast", [x], [h], to=TensorProto.FLOAT16, name=f"{x}_CastF16"),
               helper.make_node("Cast", [h], [f], to=TensorProto.FLOAT, name=f"{x}_CastF32"))
        ed.act_cache[key] = f
    node.input[0] = ed.act_cache[key]


def _fp4_dynamic_activation(ed: _Editor, node: onnx.NodeProto, amax: float) -> None:
    """TensorRT's dynamic FP4: TRT_FP4DynamicQuantize -> trt::DequantizeLinear (scales) -> trt::DequantizeLinear."""
    x, key = node.input[0], (node.input[0], "fp4")
    if key not in ed.act_cache:
        s2 = ed.init(_scalar(f"{x}_fp4_tensor_scale", float(L.nvfp4_tensor_scale(amax))))
        xf4, sf8, sf32, dq = f"{x}_f4", f"{x}_f8_scale", f"{x}_f32_scale", f"{x}_fp4_dq"
        ed.add(node.name,
               helper.make_node("TRT_FP4DynamicQuantize", [x, s2], [xf4, sf8], name=f"{x}_TRT_FP4DynamicQuantize",
                                domain=TRT_DOMAIN, axis=-1, block_size=L.NVFP4_BLOCK, scale_type=TensorProto.FLOAT8E4M3FN),
               helper.make_node("DequantizeLinear", [sf8, s2], [sf32], name=f"{x}_DequantizeLinear", domain=TRT_DOMAIN),
               helper.make_node("DequantizeLinear", [xf4, sf32], [dq], name=f"{x}_DequantizeLinear_1", domain=TRT_DOMAIN,
                                axis=-1, block_size=L.NVFP4_BLOCK))
        ed.typed(xf4, TensorProto.FLOAT4E2M1)
        ed.typed(sf8, TensorProto.FLOAT8E4M3FN)
        ed.typed(sf32, TensorProto.FLOAT)
        ed.typed(dq, TensorProto.FLOAT)
        ed.act_cache[key] = dq
    node.input[0] = ed.act_cache[key]


# --- weights ---------------------------------------------------------------------------------

def _fp8_weight(ed: _Editor, node: onnx.NodeProto, w: np.ndarray, name: str) -> str:
    lay = weight_layout(node, w.ndim)
    scale = L.channel_scale(w, lay.out_axis)
    q = L.fp8_quantize(w, scale, lay.out_axis)
    wq = ed.init(fp8_tensor(f"{name}_fp8", q))
    s = ed.init(numpy_helper.from_array(scale, f"{name}_fp8_scale"))
    out = f"{name}_fp8_dq"
    ed.add(node.name, helper.make_node("DequantizeLinear", [wq, s], [out], axis=lay.out_axis, name=f"{name}_DequantizeLinear"))
    return out


def _nvfp4_weight(ed: _Editor, node: onnx.NodeProto, w: np.ndarray, name: str, trt_layout: bool) -> str:
    """Two DQs: (E4M3 block scales, f32 tensor scale) -> scales; (E2M1 values, scales) -> weight.

    trt_layout: a MatMul weight (K, N) is stored as Model Optimizer stores a Linear weight, (N, K)
    with blocks along the last axis, and transposed back in front of the MatMul.
    """
    lay = weight_layout(node, w.ndim)
    transpose = trt_layout and node.op_type == "MatMul" and w.ndim == 2
    if transpose:
        w, axis = w.T, 1
    else:
        axis = lay.in_axis
    t = L.nvfp4_quantize(w, axis=axis)
    wf4 = ed.init(fp4_tensor(f"{name}_f4", t.values))
    sf8 = ed.init(fp8_tensor(f"{name}_f8_scale", t.block_scales))
    s2 = ed.init(_scalar(f"{name}_f8_scale_f32_scale", float(t.tensor_scale)))
    scales, out = f"{name}_f32_scale", f"{name}_fp4_dq"
    ed.add(node.name,
           helper.make_node("DequantizeLinear", [sf8, s2], [scales], name=f"{name}_DequantizeLinear"),
           helper.make_node("DequantizeLinear", [wf4, scales], [out], name=f"{name}_DequantizeLinear_1",
                            axis=axis - w.ndim if transpose else axis, block_size=L.NVFP4_BLOCK))
    if transpose:
        ed.add(node.name, helper.make_node("Transpose", [out], [f"{out}_t"], perm=[1, 0], name=f"{name}_Transpose"))
        return f"{out}_t"
    return out


def _fp16_weight(ed: _Editor, node: onnx.NodeProto, w: np.ndarray, name: str) -> str:
    """A layer kept 16-bit: its weight stored as float16 and cast to float in front of it."""
    h = ed.init(numpy_helper.from_array(w.astype(np.float16), f"{name}_f16"))
    out = f"{name}_f16_f32"
    ed.add(node.name, helper.make_node("Cast", [h], [out], to=TensorProto.FLOAT, name=f"{name}_CastF32"))
    return out


def _keep_16bit(ed: _Editor, model: onnx.ModelProto, users: dict[str, int], keep16, simulate: bool) -> None:
    """Layers kept 16-bit: float16 weights; in a simulation graph their inputs are rounded through
    float16 too (what the stored graph leaves to the compute precision, as nvfp4's fp16 activations)."""
    for n in _chosen(model, list(keep16)):
        if simulate:
            _fp16_activation(ed, n)
        _replace_weight(ed, n, users, lambda w, name, n=n: _fp16_weight(ed, n, w, name))


def _replace_weight(ed: _Editor, node: onnx.NodeProto, users: dict[str, int], make) -> None:
    name = node.input[1]
    t = ed.inits[name]
    new = make(numpy_helper.to_array(t).astype(np.float32), name)
    node.input[1] = new
    users[name] -= 1
    if users[name] == 0:
        ed.drop.add(name)


# --- the three graphs ------------------------------------------------------------------------

def _amax(ranges: dict[str, tuple[float, float]], x: str) -> float:
    if x not in ranges:
        raise ValueError(f"no calibrated range for activation {x!r}")
    lo, hi = ranges[x]
    return max(abs(lo), abs(hi))


_copy = copy_model  # a ModelProto deep copy (onnxio.files)


def fp8_graph(model: onnx.ModelProto, nodes: list[str], ranges: dict, opset: int, keep16=()) -> onnx.ModelProto:
    """Portable FP8 QDQ: E4M3 weights per output channel, E4M3 activations per tensor; the `keep16`
    layers with float16 weights."""
    m = upgrade_opset(_copy(model), max(opset, FP8_MIN_OPSET))
    ed, users = _Editor(m), _weight_users(m)
    for n in _chosen(m, nodes):
        _fp8_activation(ed, n, _amax(ranges, n.input[0]))
        _replace_weight(ed, n, users, lambda w, name, n=n: _fp8_weight(ed, n, w, name))
    _keep_16bit(ed, m, users, keep16, simulate=False)
    return ed.finish()


def nvfp4_graph(model: onnx.ModelProto, nodes: list[str], activations: str, ranges: dict,
                form: str = "portable", keep16=()) -> onnx.ModelProto:
    """NVFP4 weights; activations fp16 (left float) | fp8 (static Q/DQ) | fp4 (dynamic; TensorRT form only).

    form: portable (opset 23 Q/DQ) | tensorrt (Model Optimizer's export pattern). `keep16`: layers
    with float16 weights and float activations.
    """
    if activations == "fp4" and form != "tensorrt":
        raise UserError("dynamic FP4 activations exist only as TensorRT's TRT_FP4DynamicQuantize: use form tensorrt")
    m = upgrade_opset(_copy(model), FP4_OPSET)
    trt = form == "tensorrt"
    ed, users = _Editor(m), _weight_users(m)
    for n in _chosen(m, nodes):
        if activations == "fp8":
            _fp8_activation(ed, n, _amax(ranges, n.input[0]))
        elif activations == "fp4":
            _fp4_dynamic_activation(ed, n, _amax(ranges, n.input[0]))
        _replace_weight(ed, n, users, lambda w, name, n=n: _nvfp4_weight(ed, n, w, name, trt))
    _keep_16bit(ed, m, users, keep16, simulate=False)
    if trt and not any(o.domain == TRT_DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return ed.finish()


def simulation_graph(model: onnx.ModelProto, nodes: list[str], weights: str, activations: str,
                     ranges: dict, keep16=()) -> onnx.ModelProto:
    """fp32 graph computing what the portable graph computes, runnable on ONNX Runtime's CPU provider.

    weights: fp8 | nvfp4 (replaced by the twin's dequantized values); activations: fp16 (rounded
    through float16) | fp8 (FP8 Q/DQ, which ORT's CPU provider runs) | fp4 (not simulated).
    `keep16`: layers kept 16-bit (float16 weights, inputs rounded through float16).
    """
    if activations not in ("fp16", "fp8"):
        raise UserError(f"no CPU simulation of {activations} activations (ONNX Runtime has no FLOAT4E2M1 kernel)")
    m = upgrade_opset(_copy(model), FP8_MIN_OPSET) if activations == "fp8" else _copy(model)
    ed, users = _Editor(m), _weight_users(m)

    def fake(n, w, name):
        lay = weight_layout(n, w.ndim)
        if weights == "fp8":
            v = L.fp8_fake(w, L.channel_scale(w, lay.out_axis), lay.out_axis)
        else:
            v = L.nvfp4_fake(w, axis=lay.in_axis)
        return ed.init(numpy_helper.from_array(v, f"{name}_{weights}_sim"))

    for n in _chosen(m, nodes):
        if activations == "fp8":
            _fp8_activation(ed, n, _amax(ranges, n.input[0]))
        else:
            _fp16_activation(ed, n)
        _replace_weight(ed, n, users, lambda w, name, n=n: fake(n, w, name))
    _keep_16bit(ed, m, users, keep16, simulate=True)
    return ed.finish()


TRT_OUTPUT_TYPES = {
    "TRT_FP4DynamicQuantize": (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E4M3FN),
    "DequantizeLinear": (TensorProto.FLOAT,),
    "TRT_FP8QuantizeLinear": (TensorProto.FLOAT8E4M3FN,),
    "TRT_FP8DequantizeLinear": (TensorProto.FLOAT,),
}
