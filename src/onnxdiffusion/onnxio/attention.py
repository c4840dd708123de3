"""ONNX Runtime's fused attention (com.microsoft.MultiHeadAttention) written out as standard ops: what the
quantize side does to reach the score and value matmuls, and what a graph needs before ONNX Runtime's OpenVINO
provider can take it whole (OpenVINO has no such operator: the provider would run the graph in pieces around
each one, 4.2x slower at SD1.5 size, experiments/amx). Pure `onnx` + numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

MHA = "MultiHeadAttention"


def plain_attention(n: onnx.NodeProto) -> bool:
    """A fused attention of query, key and value alone (no bias, mask, cache or causal masking, one output),
    with its scale: what decompose_attention writes out (and portable rounding computes in float64)."""
    if n.op_type != MHA or n.domain != "com.microsoft":
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return (len(n.input) == 3 and all(n.input) and "scale" in attrs and not attrs.get("unidirectional", 0)
            and not any(n.output[1:]))


def decompose_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every plain fused MultiHeadAttention (query, key, value; no bias or mask) written
    as standard ops; other nodes, names and weights unchanged. Computes what the fused kernel
    computes up to float rounding."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    nodes: list[onnx.NodeProto] = []
    shape3 = "opgroups/shape_merge"  # the name quantized folders already carry
    used = False
    for n in g.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if not plain_attention(n):
            nodes.append(n)
            continue
        used = True
        heads, scale = int(attrs["num_heads"]), float(attrs["scale"])
        p = n.name.rsplit("/", 1)[0] if "/" in n.name else n.name
        q, k, v = n.input[:3]
        heads_shape = f"{p}/heads_shape"
        g.initializer.append(numpy_helper.from_array(np.array([0, 0, heads, -1], np.int64), heads_shape))
        g.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), f"{p}/attn_scale"))

        def node(op, ins, outs_, name, **kw):
            nodes.append(helper.make_node(op, ins, outs_, name=f"{p}/{name}", **kw))
            return outs_[0]

        qh = node("Transpose", [node("Reshape", [q, heads_shape], [f"{p}/q4"], "q_heads")], [f"{p}/qT"], "q_t", perm=[0, 2, 1, 3])
        kh = node("Transpose", [node("Reshape", [k, heads_shape], [f"{p}/k4"], "k_heads")], [f"{p}/kT"], "k_t", perm=[0, 2, 3, 1])
        vh = node("Transpose", [node("Reshape", [v, heads_shape], [f"{p}/v4"], "v_heads")], [f"{p}/vT"], "v_t", perm=[0, 2, 1, 3])
        scores = node("MatMul", [qh, kh], [f"{p}/scores"], "attn_scores/MatMul")
        scaled = node("Mul", [scores, f"{p}/attn_scale"], [f"{p}/scaled"], "attn_scale/Mul")
        probs = node("Softmax", [scaled], [f"{p}/probs"], "attn_softmax/Softmax", axis=-1)
        ctx = node("MatMul", [probs, vh], [f"{p}/ctx"], "attn_values/MatMul")
        ctx_t = node("Transpose", [ctx], [f"{p}/ctxT"], "ctx_t", perm=[0, 2, 1, 3])
        node("Reshape", [ctx_t, shape3], [n.output[0]], "merge_heads")
    if used:
        g.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), shape3))
    del g.node[:]
    g.node.extend(nodes)
    return out


def openvino_form(path: Path) -> bytes | None:
    """The graph at `path` with its plain fused attention written out, for ONNX Runtime's OpenVINO provider;
    None when there is none to write out, or when its weights are external (a > 2 GB graph cannot be
    serialized in one piece: it keeps the fused nodes, and the pipeline says so)."""
    model = onnx.load(str(path), load_external_data=False)
    if not any(plain_attention(n) for n in model.graph.node) or any(
            t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None
    return decompose_attention(model).SerializeToString()
