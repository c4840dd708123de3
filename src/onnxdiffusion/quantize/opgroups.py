"""Op groups an int8 recipe may keep float, found from the graph's structure (no model-kind names),
and the graph rewrites that make them quantizable.

- modulation: constant-weight linears fed only by vector conditioning (timestep, pooled text,
  SDXL's size ids): no path from the token-wise inputs `sample` / `encoder_hidden_states`
  reaches them except through Shape. On an MMDiT these are the adaLN linears and the
  time/text embedders; on a UNet the time embedding and its per-resnet projections.
- attention: the score (Q K^T) and value (P V) matmuls, i.e. MatMuls of two activations. ORT's
  fused `com.microsoft.MultiHeadAttention` hides them; onnxio.attention.decompose_attention rewrites each fused
  node as Reshape/Transpose -> MatMul -> Mul(scale) -> Softmax -> MatMul -> Transpose/Reshape.
- softmax: Softmax nodes (exist once attention is decomposed).
- norms: Layer / Instance / Group normalization.

Pure `onnx` + numpy; nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..onnxio.attention import MHA
from . import files
from .graphs import constant_outputs, initializer_map, quantizable_nodes, remove_dead_nodes

TOKEN_INPUTS = ("sample", "encoder_hidden_states")
NORM_OPS = ("LayerNormalization", "InstanceNormalization", "GroupNormalization")
GROUP_OP_TYPES = {"attention": ("MatMul",), "softmax": ("Softmax",), "norms": NORM_OPS, "modulation": ("MatMul", "Gemm")}


def token_dependent(model: onnx.ModelProto, inputs: Iterable[str] = TOKEN_INPUTS) -> set[str]:
    """Tensors computed from the token-wise inputs (Shape/Size outputs carry no values of theirs)."""
    live = set(inputs)
    for n in model.graph.node:  # exported graphs are topologically sorted
        if n.op_type in ("Shape", "Size"):
            continue
        if any(x in live for x in n.input):
            live.update(o for o in n.output if o)
    return live


def modulation_nodes(model: onnx.ModelProto, op_types: Iterable[str], keep_float: Iterable[str] = ()) -> list[str]:
    """Quantizable linears whose data input does not depend on the token-wise inputs."""
    live = token_dependent(model)
    by_name = {n.name: n for n in model.graph.node}
    return [q.name for q in quantizable_nodes(model, op_types, keep_float) if by_name[q.name].input[0] not in live]


def attention_matmuls(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes with no constant input: attention scores and attention x values."""
    consts = set(initializer_map(model)) | constant_outputs(model)
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and not any(x in consts for x in n.input[:2])]


def nodes_of(model: onnx.ModelProto, op_types: Iterable[str]) -> list[str]:
    ops = set(op_types)
    return [n.name for n in model.graph.node if n.op_type in ops]


def norm_constants_as_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """In place: Constant nodes read by normalization ops become initializers (the QDQ quantizer
    takes a norm's scale and bias as weights only when they are initializers)."""
    g = model.graph
    norm_inputs = {x for n in g.node if n.op_type in NORM_OPS for x in n.input[1:]}
    keep = []
    for n in g.node:
        if n.op_type == "Constant" and n.output[0] in norm_inputs and n.attribute and n.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            g.initializer.append(t)
        else:
            keep.append(n)
    del g.node[:]
    g.node.extend(keep)
    return model


def fused_attention_count(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == MHA)


def gemms_as_matmuls(model: onnx.ModelProto, names: Iterable[str]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy where each named constant-weight Gemm (alpha = beta = 1, transA = 0) is MatMul (+ Add of
    its bias): what MatMulNBits can take. The MatMul keeps the Gemm's name. Returns (model, rewritten)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = initializer_map(out)
    wanted = set(names)
    nodes, done = [], []
    for n in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        ok = (n.op_type == "Gemm" and n.name in wanted and n.input[1] in inits and attrs.get("transA", 0) == 0
              and float(attrs.get("alpha", 1.0)) == 1.0 and float(attrs.get("beta", 1.0)) == 1.0)
        if not ok:
            nodes.append(n)
            continue
        w = files.array(out, inits[n.input[1]])
        if attrs.get("transB", 0):
            w = w.T
        wname = f"{n.name}/weight_kn"
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w, np.float32), wname))
        has_bias = len(n.input) > 2 and n.input[2]
        mm_out = f"{n.name}/matmul_out" if has_bias else n.output[0]
        nodes.append(helper.make_node("MatMul", [n.input[0], wname], [mm_out], name=n.name))
        if has_bias:
            nodes.append(helper.make_node("Add", [mm_out, n.input[2]], [n.output[0]], name=f"{n.name}/bias"))
        done.append(n.name)
    del g.node[:]
    g.node.extend(nodes)
    remove_dead_nodes(out)  # the transposed Gemm weights
    return out, done


def smoothable(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, list[str]]:
    """Activation tensor -> the named MatMuls reading it with a constant 2-D (K, N) weight."""
    inits = initializer_map(model)
    wanted = set(names)
    out: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.name in wanted and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            out.setdefault(n.input[0], []).append(n.name)
    return out


def apply_smoothing(model: onnx.ModelProto, scales: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict]:
    """x W == (x / s)(s W): each activation in `scales` is divided per channel by s (folded into the
    producing LayerNormalization's scale and bias when it has no other reader, else one Mul) and
    the rows of every constant MatMul weight reading it multiplied by s. Returns (copy, counts)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = initializer_map(out)
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    graph_outputs = {o.name for o in g.output}
    counts = {"folded_into_norm": 0, "mul_inserted": 0, "weights_scaled": 0}
    new_nodes: dict[str, onnx.NodeProto] = {}
    for x, s in scales.items():
        s = np.asarray(s, np.float32)
        mms = [n for n in readers.get(x, []) if n.op_type == "MatMul" and n.input[0] == x and n.input[1] in inits]
        for mm in mms:
            w = files.array(out, inits[mm.input[1]])
            scaled = numpy_helper.from_array((w * s[:, None]).astype(np.float32), f"{mm.name}/smoothed_weight")
            g.initializer.append(scaled)
            mm.input[1] = scaled.name
            counts["weights_scaled"] += 1
        ln = producer.get(x)
        foldable = (ln is not None and ln.op_type == "LayerNormalization" and len(ln.input) >= 3 and ln.input[1] in inits
                    and ln.input[2] in inits and x not in graph_outputs and len(ln.output) == 1
                    and all(r in mms for r in readers.get(x, [])))
        if foldable:
            gamma = files.array(out, inits[ln.input[1]]) / s
            beta = files.array(out, inits[ln.input[2]]) / s
            g.initializer.append(numpy_helper.from_array(gamma.astype(np.float32), f"{ln.name}/smoothed_scale"))
            g.initializer.append(numpy_helper.from_array(beta.astype(np.float32), f"{ln.name}/smoothed_bias"))
            ln.input[1], ln.input[2] = f"{ln.name}/smoothed_scale", f"{ln.name}/smoothed_bias"
            counts["folded_into_norm"] += 1
            continue
        inv = f"{x}/smooth_inv"
        g.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
        smoothed = f"{x}/smoothed"
        new_nodes[x] = helper.make_node("Mul", [x, inv], [smoothed], name=f"{mms[0].name}/smooth")
        for mm in mms:
            mm.input[0] = smoothed
        counts["mul_inserted"] += 1
    if new_nodes:  # each Mul right after its input's producer keeps the graph sorted
        nodes = [new_nodes[i.name] for i in g.input if i.name in new_nodes]
        for n in g.node:
            nodes.append(n)
            nodes.extend(new_nodes[o] for o in n.output if o in new_nodes)
        del g.node[:]
        g.node.extend(nodes)
    remove_dead_nodes(out)
    return out, counts


def smoothing_scales(act_absmax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """SmoothQuant's s_k = max|x_k|^alpha / max|w_k|^(1 - alpha) over the weights sharing the input;
    1 where a channel never fires or has no weight, clipped to [1e-4, 1e4]."""
    a = np.asarray(act_absmax, np.float64)
    w = np.max([np.abs(np.asarray(wt, np.float64)).max(axis=1) for wt in weights], axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.power(a, alpha) / np.power(w, 1.0 - alpha)
    s = np.where((a > 0) & (w > 0) & np.isfinite(s), s, 1.0)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)
