"""int8-static's `rounding=portable`: the CPU-fused backbone's float kernels rewritten so that every ONNX Runtime
build rounds them alike (x86 ORT CPU for `generate`, onnxruntime-web's WASM for the page).

On identical inputs the two builds' integer kernels agree, but the float kernels between them (norms, GELUs,
tanh, sin/cos, float attention) differ by an ulp in 3-97% of their elements and QLinearAdd / QLinearSoftmax
by one step in a few; the QuantizeLinears after them and 20 guided steps amplify that (page vs generate fell
to 33 dB; one-ulp nudges on ORT CPU alone give the same spread). Each such op is rewritten so that whatever
depends on summation order or on a transcendental function runs in float64 and is cast back to float32
(double arithmetic is correctly rounded on both builds and its small differences, ~1e-16, vanish in the
cast), and the rest stays in float32 elementwise arithmetic (Add, Sub, Mul, Div: IEEE-exact on every build):
norms take their mean and 1/sqrt(var + eps) in float64 and normalize in float32; sigmoid-based GELUs take
only exp in float64; erf is Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7) in float32 with exp in float64;
attention (both matmuls and the softmax) runs in float64 on float32-reshaped heads; tanh, sin, cos, softmax
and float MatMuls run wholly in float64; QLinear ops become Dequantize -> ... -> Quantize. The sigmoid is
x / (1 + exp(-a x)) so that ORT's fusions cannot turn it back into a float-only QuickGelu.
bench/web_drift.py measures which ops drift and what leaving each one out does to the page's image.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..onnxio.attention import plain_attention

LOWERED = ("InstanceNormalization", "LayerNormalization", "QuickGelu", "Gelu", "Sigmoid", "Softmax", "QLinearSoftmax",
           "QLinearAdd", "Sin", "Cos", "Tanh", "MatMul", "MultiHeadAttention")
# float ops that also round differently across builds, left as they are when met (reported)
UNHANDLED = ("FastGelu", "BiasGelu", "SkipLayerNormalization", "SimplifiedLayerNormalization",
             "Attention", "Erf", "Exp", "Pow", "GroupNorm", "Conv", "Gemm", "ReduceMean", "ReduceSum")
ERF_AS = (0.3275911, (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592))


class _Rewriter:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[onnx.TensorProto] = []
        self.k = 0

    def name(self, hint: str) -> str:
        self.k += 1
        return f"portable_rounding/{self.k}_{hint}"

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type)
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def const(self, value, dtype=np.float64) -> str:
        name = self.name("c")
        self.consts.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def double(self, x: str) -> str:
        return self.op("Cast", [x], to=TensorProto.DOUBLE)

    def to_float(self, x: str, out: str) -> None:
        self.nodes.append(helper.make_node("Cast", [x], [out], to=TensorProto.FLOAT))

    # -- the float64 formulas --------------------------------------------------------------------------
    def fconst(self, value) -> str:
        return self.const(value, np.float32)

    def exp32(self, x: str) -> str:
        """exp of a float32 tensor, evaluated in float64 and cast back."""
        return self.op("Cast", [self.op("Exp", [self.double(x)])], to=TensorProto.FLOAT)

    def stats(self, x: str, axis: int, eps: float) -> tuple[str, str]:
        """(mean, 1 / sqrt(var + eps)) of float32 `x` over `axis` (keepdims), in float64, cast to float32."""
        xd = self.double(x)
        mean = self.op("ReduceMean", [xd], axes=[axis], keepdims=1)
        square_mean = self.op("ReduceMean", [self.op("Mul", [xd, xd])], axes=[axis], keepdims=1)
        var = self.op("Sub", [square_mean, self.op("Mul", [mean, mean])])
        rstd = self.op("Div", [self.const(1.0), self.op("Sqrt", [self.op("Add", [var, self.const(eps)])])])
        return self.op("Cast", [mean], to=TensorProto.FLOAT), self.op("Cast", [rstd], to=TensorProto.FLOAT)

    def normalized(self, x: str, axis: int, eps: float, scale: str) -> str:
        """(x - mean) * rstd * scale, in float32 with float64 statistics."""
        mean, rstd = self.stats(x, axis, eps)
        return self.op("Mul", [self.op("Mul", [self.op("Sub", [x, mean]), rstd]), scale])

    def instance_norm(self, n: onnx.NodeProto, eps: float) -> None:
        x, scale, bias = n.input
        shape = self.op("Shape", [x])
        flat = self.op("Reshape", [x, self.const([0, 0, -1], np.int64)])  # (N, C, everything else)
        per_channel = self.const([-1, 1], np.int64)
        y = self.normalized(flat, 2, eps, self.op("Reshape", [scale, per_channel]))
        y = self.op("Add", [y, self.op("Reshape", [bias, per_channel])])
        self.nodes.append(helper.make_node("Reshape", [y, shape], [n.output[0]]))

    def layer_norm(self, n: onnx.NodeProto, eps: float) -> None:
        x, scale, *bias = n.input
        y = self.normalized(x, -1, eps, scale)
        self.nodes.append(helper.make_node("Add", [y, bias[0]], [n.output[0]]) if bias and bias[0]
                          else helper.make_node("Identity", [y], [n.output[0]]))

    def sigmoid_times(self, x: str, alpha: float, out: str, times_x: bool = True) -> None:
        """x * sigmoid(alpha x) (or sigmoid(alpha x)) as x / (1 + exp(-alpha x)) in float32, exp in float64."""
        e = self.exp32(self.op("Mul", [x, self.fconst(-alpha)]))
        den = self.op("Add", [e, self.fconst(1.0)])
        self.nodes.append(helper.make_node("Div", [x if times_x else self.fconst(1.0), den], [out]))

    def erf(self, z: str) -> str:
        """Abramowitz-Stegun 7.1.26 in float32, its exp in float64."""
        p, coeffs = ERF_AS
        a = self.op("Abs", [z])
        t = self.op("Div", [self.fconst(1.0), self.op("Add", [self.fconst(1.0), self.op("Mul", [a, self.fconst(p)])])])
        poly = self.fconst(coeffs[0])
        for c in coeffs[1:]:
            poly = self.op("Add", [self.op("Mul", [poly, t]), self.fconst(c)])
        poly = self.op("Mul", [poly, t])
        g = self.exp32(self.op("Neg", [self.op("Mul", [a, a])]))
        return self.op("Mul", [self.op("Sign", [z]), self.op("Sub", [self.fconst(1.0), self.op("Mul", [poly, g])])])

    def softmax(self, x: str, axis: int) -> str:
        e = self.op("Exp", [self.op("Sub", [x, self.op("ReduceMax", [x], axes=[axis], keepdims=1)])])
        return self.op("Div", [e, self.op("ReduceSum", [e, self.const([axis], np.int64)], keepdims=1)])

    def rewrite(self, n: onnx.NodeProto) -> bool:
        """Append `n`'s portable form (True), or nothing (False: keep `n`)."""
        t, a = n.op_type, {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.domain not in ("", "ai.onnx", "com.microsoft"):
            return False
        if t == "InstanceNormalization":
            self.instance_norm(n, a.get("epsilon", 1e-5))
        elif t == "LayerNormalization" and a.get("axis", -1) == -1 and not any(n.output[1:]):
            self.layer_norm(n, a.get("epsilon", 1e-5))
        elif t == "QuickGelu":
            self.sigmoid_times(n.input[0], a.get("alpha", 1.702), n.output[0])
        elif t == "Sigmoid" and n.domain in ("", "ai.onnx"):
            self.sigmoid_times(n.input[0], 1.0, n.output[0], times_x=False)
        elif t == "Gelu" and n.domain == "com.microsoft":
            x = n.input[0]
            e = self.erf(self.op("Mul", [x, self.fconst(1 / np.sqrt(2.0))]))
            self.nodes.append(helper.make_node("Mul", [self.op("Mul", [x, self.fconst(0.5)]),
                                                      self.op("Add", [e, self.fconst(1.0)])], [n.output[0]]))
        elif t == "Softmax" and n.domain in ("", "ai.onnx"):
            self.to_float(self.softmax(self.double(n.input[0]), a.get("axis", -1)), n.output[0])
        elif t == "QLinearSoftmax" and a.get("opset", 13) >= 13:
            x, sx, zx, sy, zy = n.input
            y = self.softmax(self.double(self.op("DequantizeLinear", [x, sx, zx])), a.get("axis", -1))
            self.nodes.append(helper.make_node("QuantizeLinear", [self.op("Cast", [y], to=TensorProto.FLOAT), sy, zy],
                                               [n.output[0]]))
        elif t == "QLinearAdd" and len(n.input) == 8:
            xa, sa, za, xb, sb, zb, sc, zc = n.input
            total = self.op("Sum", [self.op("DequantizeLinear", [xa, sa, za]), self.op("DequantizeLinear", [xb, sb, zb])])
            self.nodes.append(helper.make_node("QuantizeLinear", [total, sc, zc], [n.output[0]]))
        elif plain_attention(n):
            self.attention(n, int(a["num_heads"]), float(a["scale"]))
        elif t == "Tanh" and n.domain in ("", "ai.onnx"):  # 1 - 2 / (exp(2x) + 1)
            e = self.op("Exp", [self.op("Mul", [self.double(n.input[0]), self.const(2.0)])])
            y = self.op("Sub", [self.const(1.0), self.op("Div", [self.const(2.0), self.op("Add", [e, self.const(1.0)])])])
            self.to_float(y, n.output[0])
        elif t in ("Sin", "Cos") and n.domain in ("", "ai.onnx"):
            self.to_float(self.op(t, [self.double(n.input[0])]), n.output[0])
        elif t == "MatMul" and n.domain in ("", "ai.onnx"):
            self.to_float(self.op("MatMul", [self.double(n.input[0]), self.double(n.input[1])]), n.output[0])
        else:
            return False
        return True

    def attention(self, n: onnx.NodeProto, heads: int, scale: float) -> None:
        """softmax(q k^T * scale) v per head, (B, S, H*D) in and out (com.microsoft MultiHeadAttention's plain form):
        heads split and merged in float32, the two matmuls and the softmax in float64."""
        split = self.const([0, 0, heads, -1], np.int64)

        def per_head(x: str, perm: list[int]) -> str:
            return self.double(self.op("Transpose", [self.op("Reshape", [x, split])], perm=perm))

        q, k, v = per_head(n.input[0], [0, 2, 1, 3]), per_head(n.input[1], [0, 2, 3, 1]), per_head(n.input[2], [0, 2, 1, 3])
        scores = self.op("Mul", [self.op("MatMul", [q, k]), self.const(scale)])
        out = self.op("Cast", [self.op("MatMul", [self.softmax(scores, -1), v])], to=TensorProto.FLOAT)
        self.nodes.append(helper.make_node("Reshape", [self.op("Transpose", [out], perm=[0, 2, 1, 3]),
                                                       self.const([0, 0, -1], np.int64)], [n.output[0]]))


def _float_typed(graph: onnx.GraphProto) -> set[str]:
    """Names known to hold float32 (inputs, initializers, value_info); unknown names are taken to be float."""
    known = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    known.update({t.name: t.data_type for t in graph.initializer})
    return {k for k, v in known.items() if v != TensorProto.FLOAT}


def portable_rounding(model: onnx.ModelProto, op_types=LOWERED) -> dict:
    """Rewrite `model`'s main graph in place (see the module docstring); returns {lowered: {op: n}, kept: {op: n}}.
    `op_types`: the LOWERED op types to rewrite (all of them: the recipe; fewer: bench/web_drift.py's study)."""
    g = model.graph
    not_float = _float_typed(g)
    rw = _Rewriter(g)
    lowered: dict[str, int] = {}
    kept: dict[str, int] = {}
    for n in g.node:
        float_in = bool(n.input) and n.input[0] not in not_float
        if n.op_type in op_types and (float_in or n.op_type.startswith("QLinear")) and rw.rewrite(n):
            lowered[n.op_type] = lowered.get(n.op_type, 0) + 1
            continue
        rw.nodes.append(n)
        if n.op_type in UNHANDLED or n.op_type in LOWERED:
            kept[n.op_type] = kept.get(n.op_type, 0) + 1
    del g.node[:]
    g.node.extend(rw.nodes)
    g.initializer.extend(rw.consts)
    return {"lowered": dict(sorted(lowered.items())), "kept": dict(sorted(kept.items()))}
