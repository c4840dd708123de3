"""int8-static's `rounding=portable`: the CPU-fused backbone's float kernels rewritten so that every ONNX Runtime
build rounds them alike (x86 ORT CPU for `generate`, onnxruntime-web's WASM for the page).

On identical inputs the two builds' integer kernels agree, but the float kernels between them (norms, GELUs,
tanh, sin/cos, float attention) differ by an ulp in 3-92% of their elements and QLinearAdd / QLinearSoftmax
by one step in a few; the QuantizeLinears after them and 20 guided steps amplify that (page vs generate fell
to 32 dB; one-ulp nudges on ORT CPU alone give the same spread). Each such op becomes Cast -> float64
elementary ops (Add, Mul, Div, Sqrt, Exp, Reduce*, MatMul; erf by Abramowitz-Stegun 7.1.26, |error| < 1.5e-7)
-> Cast back (QLinear ops: Dequantize -> ... -> Quantize): double arithmetic is correctly rounded on both
builds and its small differences (~1e-16) vanish in the cast to float32. The sigmoid is x / (1 + exp(-a x))
so that ORT's fusions cannot turn it back into a float-only QuickGelu.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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
    def normalize(self, x: str, axis: int, eps: float) -> str:
        """(x - mean) / sqrt(var + eps) over `axis` (keepdims)."""
        mean = self.op("ReduceMean", [x], axes=[axis], keepdims=1)
        d = self.op("Sub", [x, mean])
        var = self.op("ReduceMean", [self.op("Mul", [d, d])], axes=[axis], keepdims=1)
        return self.op("Div", [d, self.op("Sqrt", [self.op("Add", [var, self.const(eps)])])])

    def instance_norm(self, n: onnx.NodeProto, eps: float) -> None:
        x, scale, bias = n.input
        shape = self.op("Shape", [x])
        flat = self.op("Reshape", [self.double(x), self.const([0, 0, -1], np.int64)])  # (N, C, everything else)
        y = self.normalize(flat, 2, eps)
        per_channel = self.const([-1, 1], np.int64)
        y = self.op("Mul", [y, self.op("Reshape", [self.double(scale), per_channel])])
        y = self.op("Add", [y, self.op("Reshape", [self.double(bias), per_channel])])
        self.to_float(self.op("Reshape", [y, shape]), n.output[0])

    def layer_norm(self, n: onnx.NodeProto, eps: float) -> None:
        x, scale, *bias = n.input
        y = self.op("Mul", [self.normalize(self.double(x), -1, eps), self.double(scale)])
        if bias and bias[0]:
            y = self.op("Add", [y, self.double(bias[0])])
        self.to_float(y, n.output[0])

    def sigmoid_times(self, x: str, alpha: float) -> str:
        """x * sigmoid(alpha x) as x / (1 + exp(-alpha x)) (x: double)."""
        e = self.op("Exp", [self.op("Mul", [x, self.const(-alpha)])])
        return self.op("Div", [x, self.op("Add", [e, self.const(1.0)])])

    def erf(self, z: str) -> str:
        p, coeffs = ERF_AS
        a = self.op("Abs", [z])
        t = self.op("Div", [self.const(1.0), self.op("Add", [self.const(1.0), self.op("Mul", [a, self.const(p)])])])
        poly = self.const(coeffs[0])
        for c in coeffs[1:]:
            poly = self.op("Add", [self.op("Mul", [poly, t]), self.const(c)])
        poly = self.op("Mul", [poly, t])
        g = self.op("Exp", [self.op("Neg", [self.op("Mul", [a, a])])])
        return self.op("Mul", [self.op("Sign", [z]), self.op("Sub", [self.const(1.0), self.op("Mul", [poly, g])])])

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
            self.to_float(self.sigmoid_times(self.double(n.input[0]), a.get("alpha", 1.702)), n.output[0])
        elif t == "Sigmoid":
            self.to_float(self._sigmoid(self.double(n.input[0])), n.output[0])
        elif t == "Gelu" and n.domain == "com.microsoft":
            x = self.double(n.input[0])
            e = self.erf(self.op("Mul", [x, self.const(1 / np.sqrt(2.0))]))
            self.to_float(self.op("Mul", [self.op("Mul", [x, self.const(0.5)]), self.op("Add", [e, self.const(1.0)])]),
                          n.output[0])
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
        elif t == "MultiHeadAttention" and len([x for x in n.input if x]) == 3 and len(n.input) == 3 and "scale" in a \
                and not a.get("unidirectional", 0) and not any(n.output[1:]):
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
        """softmax(q k^T * scale) v per head, (B, S, H*D) in and out (com.microsoft MultiHeadAttention's plain form)."""
        split = self.const([0, 0, heads, -1], np.int64)

        def per_head(x: str, perm: list[int]) -> str:
            return self.op("Transpose", [self.op("Reshape", [self.double(x), split])], perm=perm)

        q, k, v = per_head(n.input[0], [0, 2, 1, 3]), per_head(n.input[1], [0, 2, 3, 1]), per_head(n.input[2], [0, 2, 1, 3])
        scores = self.op("Mul", [self.op("MatMul", [q, k]), self.const(scale)])
        out = self.op("MatMul", [self.softmax(scores, -1), v])
        out = self.op("Reshape", [self.op("Transpose", [out], perm=[0, 2, 1, 3]), self.const([0, 0, -1], np.int64)])
        self.to_float(out, n.output[0])

    def _sigmoid(self, x: str) -> str:
        e = self.op("Exp", [self.op("Neg", [x])])
        return self.op("Div", [self.const(1.0), self.op("Add", [e, self.const(1.0)])])


def _float_typed(graph: onnx.GraphProto) -> set[str]:
    """Names known to hold float32 (inputs, initializers, value_info); unknown names are taken to be float."""
    known = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    known.update({t.name: t.data_type for t in graph.initializer})
    return {k for k, v in known.items() if v != TensorProto.FLOAT}


def portable_rounding(model: onnx.ModelProto) -> dict:
    """Rewrite `model`'s main graph in place (see the module docstring); returns {lowered: {op: n}, kept: {op: n}}."""
    g = model.graph
    not_float = _float_typed(g)
    rw = _Rewriter(g)
    lowered: dict[str, int] = {}
    kept: dict[str, int] = {}
    for n in g.node:
        float_in = bool(n.input) and n.input[0] not in not_float
        if n.op_type in LOWERED and (float_in or n.op_type.startswith("QLinear")) and rw.rewrite(n):
            lowered[n.op_type] = lowered.get(n.op_type, 0) + 1
            continue
        rw.nodes.append(n)
        if n.op_type in UNHANDLED or n.op_type in LOWERED:
            kept[n.op_type] = kept.get(n.op_type, 0) + 1
    del g.node[:]
    g.node.extend(rw.nodes)
    g.initializer.extend(rw.consts)
    return {"lowered": dict(sorted(lowered.items())), "kept": dict(sorted(kept.items()))}
