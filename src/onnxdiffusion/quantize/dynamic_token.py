"""Per-token dynamic int8 activations for the weight linears, in plain ONNX, and its numpy twin.

    model, report = dynamic_token_linears(model, names)

Static int8 gives every token of a tensor one calibrated scale; a DiT's few outlier tokens (and the
steps whose range the calibration did not see) then set the resolution of all the others. Here
each row (token) of a linear's input gets its own scale at run time, as QuaRot and ConvRot quantize
their rotated activations:

    s = max(max|x_row|, tiny) / 127              ReduceMax over the last axis, keepdims
    xq = Cast<uint8>(Round(x / s) + 128)          |x / s| <= 127 by construction: no Clip needed
    y = Cast<float>(MatMulInteger(xq, Wq, zero point 128)) * s * w_scale + b

`zero_point=True` (int8-static's `activations=dynamic-token-asym`): each token's [min, max] (zero included) over
255 levels, uint8 codes with a per-token zero point whose share, z * colsum(Wq), is subtracted from the int32
sums (measured on the MMDiT: the rotated post-GELU / post-norm rows are not centred on zero).
Weights: symmetric int8 per output channel (w_scale = max|W[:, n]| / 127), stored int8. The
token quantization of a tensor is shared by every rewritten linear reading it (q, k, v read one).
ONNX Runtime's CPU provider runs MatMulInteger uint8 x int8 with its VNNI integer GEMM; no
calibration is involved, so nothing here depends on the sampling trajectories.
Pure `onnx` + numpy; nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import files
from .gptq import int8_channels
from .graphs import initializer_map, remove_dead_nodes

QMAX = 127.0
TINY = 1e-30  # an all-zero row: scale TINY / 127, its codes 0 (never 0 / 0)
SUFFIX = "/token_int8"
# the int8 codes are stored uint8 + 128 with MatMulInteger's scalar zero point 128: ORT's u8 x s8 GEMM is its
# VNNI kernel, its s8 x s8 one a slow path (measured 10x slower at width 1024: dynamic_token_speed.py)
OFFSET = 128
OFFSET_NAME = "token_int8/zero_point_128"


# --- the numpy twin --------------------------------------------------------------------------

def token_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, per-row float32 scale with a kept last axis) of x, as the graph computes them."""
    x = np.asarray(x, np.float32)
    s = (np.maximum(np.abs(x).max(axis=-1, keepdims=True), np.float32(TINY)) / np.float32(QMAX)).astype(np.float32)
    return np.round(x / s).astype(np.int8), s


def token_quantize_asym(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint8 codes, per-row scale, per-row zero point as float) of x: each row's [min, max] (zero included)
    over 255 steps, as the graph computes them with `zero_point=True`."""
    x = np.asarray(x, np.float32)
    lo = np.minimum(x.min(axis=-1, keepdims=True), np.float32(0))
    hi = np.maximum(x.max(axis=-1, keepdims=True), np.float32(0))
    s = (np.maximum(hi - lo, np.float32(TINY)) / np.float32(2 * QMAX + 1)).astype(np.float32)
    z = np.round(-lo / s).astype(np.float32)
    q = np.clip(np.round(x / s) + z, 0, 2 * QMAX + 1).astype(np.uint8)
    return q, s, z


def weight_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 (K, N) codes, float32 (N,) scales): symmetric per output channel; an all-zero column gets scale 1."""
    w = np.asarray(w, np.float64)
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / QMAX, 1.0)
    q = np.clip(np.round(w / scale), -QMAX, QMAX).astype(np.int8)
    return q, scale.astype(np.float32)


def dynamic_token_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, zero_point: bool = False) -> np.ndarray:
    """The eager twin of one rewritten linear: x (..., K) @ w (K, N) [+ bias] with per-token int8 x."""
    wq, ws = weight_quantize(w)
    if zero_point:
        xq, s, z = token_quantize_asym(x)
        acc = (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32) - z * wq.astype(np.float32).sum(axis=0)
    else:
        xq, s = token_quantize(x)
        acc = (xq.astype(np.int64) @ wq.astype(np.int64)).astype(np.float32)
    y = acc * s * ws
    return y if bias is None else y + np.asarray(bias, np.float32)


# --- the graph rewrite -----------------------------------------------------------------------

def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _linear(model, inits, n) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The (K, N) weight and the bias (or None) of a MatMul / Gemm this rewrite takes, else None."""
    if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in inits:
        return None
    t = inits[n.input[1]]
    if len(t.dims) != 2 or t.data_type != TensorProto.FLOAT:
        return None
    w = files.array(model, t).astype(np.float32)
    if n.op_type == "MatMul":
        return w, None
    a = _attrs(n)
    if a.get("transA", 0):
        return None
    w = (w.T if a.get("transB", 0) else w) * np.float32(a.get("alpha", 1.0))
    if len(n.input) < 3 or not n.input[2]:
        return w, None
    if n.input[2] not in inits:
        return None
    b = files.array(model, inits[n.input[2]]).astype(np.float32) * np.float32(a.get("beta", 1.0))
    return (w, b) if b.ndim <= 1 else None


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value)))


def _token_nodes(x: str) -> tuple[list[onnx.NodeProto], str, str]:
    """Nodes that quantize x per token, and the names of its int8 codes and (..., 1) scales."""
    p = x + SUFFIX
    nodes = [
        _const(p + "/tiny", np.float32(TINY)),
        _const(p + "/qmax", np.float32(QMAX)),
        _const(p + "/offset", np.float32(OFFSET)),
        helper.make_node("Abs", [x], [p + "/abs"], name=p + "/Abs"),
        helper.make_node("ReduceMax", [p + "/abs"], [p + "/amax"], name=p + "/ReduceMax", axes=[-1], keepdims=1),
        helper.make_node("Max", [p + "/amax", p + "/tiny"], [p + "/amax_safe"], name=p + "/Max"),
        helper.make_node("Div", [p + "/amax_safe", p + "/qmax"], [p + "/scale"], name=p + "/Scale"),
        helper.make_node("Div", [x, p + "/scale"], [p + "/scaled"], name=p + "/Div"),
        helper.make_node("Round", [p + "/scaled"], [p + "/rounded"], name=p + "/Round"),
        helper.make_node("Add", [p + "/rounded", p + "/offset"], [p + "/shifted"], name=p + "/Offset"),
        helper.make_node("Cast", [p + "/shifted"], [p + "/codes"], name=p + "/Cast", to=TensorProto.UINT8),
    ]
    return nodes, p + "/codes", p + "/scale"


def _token_nodes_asym(x: str) -> tuple[list[onnx.NodeProto], str, str, str]:
    """Nodes that quantize x per token to uint8 with a per-row zero point: codes, (..., 1) scales, zero points."""
    p = x + SUFFIX
    nodes = [
        _const(p + "/tiny", np.float32(TINY)),
        _const(p + "/zero", np.float32(0)),
        _const(p + "/levels", np.float32(2 * QMAX + 1)),
        helper.make_node("ReduceMin", [x], [p + "/min"], name=p + "/ReduceMin", axes=[-1], keepdims=1),
        helper.make_node("ReduceMax", [x], [p + "/max"], name=p + "/ReduceMax", axes=[-1], keepdims=1),
        helper.make_node("Min", [p + "/min", p + "/zero"], [p + "/lo"], name=p + "/Lo"),
        helper.make_node("Max", [p + "/max", p + "/zero"], [p + "/hi"], name=p + "/Hi"),
        helper.make_node("Sub", [p + "/hi", p + "/lo"], [p + "/span"], name=p + "/Span"),
        helper.make_node("Max", [p + "/span", p + "/tiny"], [p + "/span_safe"], name=p + "/SpanSafe"),
        helper.make_node("Div", [p + "/span_safe", p + "/levels"], [p + "/scale"], name=p + "/Scale"),
        helper.make_node("Div", [p + "/lo", p + "/scale"], [p + "/lo_codes"], name=p + "/LoCodes"),
        helper.make_node("Neg", [p + "/lo_codes"], [p + "/neg_lo"], name=p + "/Neg"),
        helper.make_node("Round", [p + "/neg_lo"], [p + "/zp"], name=p + "/ZeroPoint"),
        helper.make_node("Div", [x, p + "/scale"], [p + "/scaled"], name=p + "/Div"),
        helper.make_node("Round", [p + "/scaled"], [p + "/rounded"], name=p + "/Round"),
        helper.make_node("Add", [p + "/rounded", p + "/zp"], [p + "/shifted"], name=p + "/Shift"),
        helper.make_node("Clip", [p + "/shifted", p + "/zero", p + "/levels"], [p + "/clipped"], name=p + "/Clip"),
        helper.make_node("Cast", [p + "/clipped"], [p + "/codes"], name=p + "/Cast", to=TensorProto.UINT8),
    ]
    return nodes, p + "/codes", p + "/scale", p + "/zp"


def dynamic_token_linears(model: onnx.ModelProto, names: Iterable[str], zero_point: bool = False,
                          hessians: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict]:
    """Every named MatMul / Gemm with a constant 2-D float weight: per-token dynamic int8 input, int8
    per-channel weight (a copy of `model` is returned). A Gemm keeps its bias, added in float.
    `hessians` (input tensor -> E[x^T x]): the weights rounded by GPTQ on the same grid (gptq.int8_channels)
    instead of to nearest."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = initializer_map(out)
    wanted = set(names)
    taken: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    for n in g.node:
        if n.name in wanted:
            lin = _linear(out, inits, n)
            if lin is not None:
                taken[n.name] = lin
    token: dict[str, tuple[str, str]] = {}
    new_nodes: list[onnx.NodeProto] = []
    added: set[str] = set()
    weights = 0
    for n in g.node:
        if n.name not in taken:
            new_nodes.append(n)
            continue
        w, b = taken[n.name]
        x = n.input[0]
        if x not in token:
            nodes, *names_ = _token_nodes_asym(x) if zero_point else (*_token_nodes(x), "")
            new_nodes.extend(nodes)
            token[x] = tuple(names_)
        codes, scale, zp = token[x]
        if not zp and OFFSET_NAME not in added:
            g.initializer.append(numpy_helper.from_array(np.uint8(OFFSET), OFFSET_NAME))
            added.add(OFFSET_NAME)
        wq, ws = weight_quantize(w) if hessians is None else int8_channels(w, hessians[x])
        p = n.name + SUFFIX
        g.initializer.append(numpy_helper.from_array(wq, p + "/W_int8"))
        g.initializer.append(numpy_helper.from_array(ws, p + "/W_scale"))
        weights += wq.size
        y = n.output[0]
        seq = [
            helper.make_node("MatMulInteger", [codes, p + "/W_int8"] + ([] if zp else [OFFSET_NAME]), [p + "/acc"],
                             name=p + "/MatMulInteger"),
            helper.make_node("Cast", [p + "/acc"], [p + "/accf"], name=p + "/CastF", to=TensorProto.FLOAT),
        ]
        acc = p + "/accf"
        if zp:  # (q - z) Wq = q Wq - z colsum(Wq): the zero point's share, per row and column
            g.initializer.append(numpy_helper.from_array(wq.astype(np.float32).sum(axis=0), p + "/W_colsum"))
            seq += [helper.make_node("Mul", [zp, p + "/W_colsum"], [p + "/zterm"], name=p + "/ZeroTerm"),
                    helper.make_node("Sub", [acc, p + "/zterm"], [p + "/acc_z"], name=p + "/SubZero")]
            acc = p + "/acc_z"
        seq += [
            helper.make_node("Mul", [acc, scale], [p + "/rows"], name=p + "/MulRows"),
            helper.make_node("Mul", [p + "/rows", p + "/W_scale"], [p + "/y" if b is not None else y], name=p + "/MulCols"),
        ]
        if b is not None:
            g.initializer.append(numpy_helper.from_array(b.astype(np.float32), p + "/bias"))
            seq.append(helper.make_node("Add", [p + "/y", p + "/bias"], [y], name=p + "/AddBias"))
        new_nodes.extend(seq)
    del g.node[:]
    g.node.extend(new_nodes)
    remove_dead_nodes(out)  # and the float weights nothing reads any more
    return out, {"linears": len(taken), "tensors": len(token), "weights_int8": int(weights)}
