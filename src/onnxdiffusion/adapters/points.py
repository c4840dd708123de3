"""LoRA insertion points: a graph rewrite that gives each targeted layer `y = W x + (x A) B`.

A and B are graph inputs whose default initializers have rank 0 ([in, 0] and [0, out]), so the
branch adds exact zeros and the plain image is unchanged (DESIGN.md measured it: x + 0 == x
bit for bit). An adapter feeds them as ordinary inputs, through `run()` or bound as OrtValues on an
IO binding (adapters/runtime.py; ORT's own LoraAdapter is ignored by `run_with_iobinding`).

The exporter names every node after its module path ("/model/down_blocks.0/attentions.0/
transformer_blocks.0/attn1/to_q/MatMul"; `model` is the export wrapper's attribute), so each
weight-carrying MatMul / Gemm / Conv maps back to the diffusers module a LoRA names. Quantized
layers as ORT's CPU provider stores them (MatMulIntegerToFloat, QGemm with float output,
QLinearConv, QLinearMatMul, MatMulNBits) get the same branch in float, reading the float activation the
integer kernel quantizes and adding to its float output: the low-rank branch never goes
through the integer kernel.

Layouts of the fed tensors (what adapters/feeds.py builds):
  linear: A [in, r], B [r, out]      (peft: lora_A.weight.T, lora_B.weight.T)
  conv:   A [r, in, kh, kw], B [out, r, 1, 1]   (peft's Conv2d lora_A / lora_B weights as they are)
A 1x1 conv (unit strides, no padding) computes its branch as two MatMuls over the channels, reading flat
views of the same A and B (_pointwise_branch); a k x k conv as two Convs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..folder.manifest import Component

SCOPES = ("linear", "all")  # linear: every Linear and 1x1 conv; all: k x k convs too (LoCon-style LoRAs)
A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
_WRAPPER = "model"  # the export wrappers' attribute holding the diffusers/transformers module


@dataclass(frozen=True)
class Target:
    module: str  # diffusers module path, e.g. down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q
    op: str  # linear | conv
    in_features: int
    out_features: int
    kernel: tuple[int, ...] = ()  # conv only

    def to_dict(self) -> dict:
        d = {"op": self.op, "in": self.in_features, "out": self.out_features}
        if self.kernel:
            d["kernel"] = list(self.kernel)
        return d

    @staticmethod
    def from_dict(module: str, d: dict) -> Target:
        return Target(module, str(d["op"]), int(d["in"]), int(d["out"]), tuple(int(k) for k in d.get("kernel", ())))


def module_path(node_name: str) -> str | None:
    """'/model/down_blocks.0/attn1/to_q/MatMul' -> 'down_blocks.0.attn1.to_q' (None: not a module's node)."""
    parts = [p for p in node_name.split("/") if p]
    if len(parts) < 3 or parts[0] != _WRAPPER:
        return None
    return ".".join(parts[1:-1])


class _Graph:
    """Producer / consumer / initializer lookups over one graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def dims(self, name: str) -> list[int] | None:
        """Dims of a constant weight: an initializer, or one DequantizeLinear of an initializer."""
        if name in self.inits:
            return list(self.inits[name].dims)
        p = self.producer.get(name)
        if p is not None and p.op_type == "DequantizeLinear" and p.input[0] in self.inits:
            return list(self.inits[p.input[0]].dims)
        return None

    def float_input(self, name: str) -> str | None:
        """The float tensor a quantized activation was made from (its QuantizeLinear's input)."""
        p = self.producer.get(name)
        if p is not None and p.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
            return p.input[0]
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _plan(g: _Graph, node: onnx.NodeProto, scope: str):
    """(target, float input, float output, conv attributes) for a weight-carrying node, or None."""
    op = node.op_type
    x, out = node.input[0] if node.input else "", node.output[0]
    if op in ("MatMul", "Gemm"):
        dims = g.dims(node.input[1])
        if dims is None or len(dims) != 2 or (op == "Gemm" and (_attr(node, "transA", 0) or not _attr(node, "transB", 0))):
            return None
        k, n = (dims[1], dims[0]) if op == "Gemm" else dims
        if g.float_input(x) is not None:  # a QDQ graph: read the float activation the Q/DQ pair rounds
            x = g.float_input(x)
        return ("linear", k, n, ()), x, out, {}
    if op == "MatMulNBits":  # int4 weight-only: the activation is float already
        return ("linear", int(_attr(node, "K")), int(_attr(node, "N")), ()), x, out, {}
    if op == "MatMulIntegerToFloat":
        dims, xf = g.dims(node.input[1]), g.float_input(x)
        if dims is None or len(dims) != 2:
            return None
        extra = {} if xf is not None else {"dequantize": (x, node.input[2], node.input[4] if len(node.input) > 4 else "")}
        return ("linear", dims[0], dims[1], ()), xf or x, out, extra
    if op == "QGemm":
        dims, xf = g.dims(node.input[3]), g.float_input(x)
        if dims is None or len(dims) != 2 or xf is None or len(node.input) > 7 and node.input[7] \
                or _attr(node, "transA", 0) or not _attr(node, "transB", 0):
            return None  # a QGemm with a quantized output would need a requantize: left without a point
        return ("linear", dims[1], dims[0], ()), xf, out, {}
    if op == "QLinearMatMul":  # an int8 attention's projections: quantized in, quantized out
        dims = g.dims(node.input[3])
        if dims is None or len(dims) != 2:
            return None
        xf, out, attrs = _quantized_io(g, node, {})
        return ("linear", dims[0], dims[1], ()), xf, out, attrs
    if op in ("Conv", "QLinearConv"):
        dims = g.dims(node.input[1] if op == "Conv" else node.input[3])
        if dims is None or len(dims) != 4 or int(_attr(node, "group", 1)) != 1:
            return None
        if scope == "linear" and tuple(dims[2:]) != (1, 1):
            return None
        attrs = {k: _attr(node, k) for k in ("strides", "pads", "dilations", "auto_pad") if _attr(node, k) is not None}
        if op == "QLinearConv":
            xf, out, attrs = _quantized_io(g, node, attrs)
        else:
            xf = g.float_input(x) or x
        return ("conv", dims[1], dims[0], tuple(dims[2:])), xf, out, attrs
    return None


def _quantized_io(g: _Graph, node: onnx.NodeProto, attrs: dict) -> tuple[str, str, dict]:
    """(float input, output to add to, attrs) of a QLinearConv / QLinearMatMul (x, x_scale, x_zp, w, w_scale,
    w_zp, y_scale, y_zp): the branch reads the float activation the input was quantized from, or the input
    dequantized; it adds after the output's DequantizeLinear, or dequantizes, adds and requantizes at the
    output's own scale when quantized ops read it."""
    x, out = node.input[0], node.output[0]
    xf = g.float_input(x)
    if xf is None:
        attrs["dequantize"] = (x, node.input[1], node.input[2])
        xf = x
    users = g.consumers.get(out, [])
    if len(users) == 1 and users[0].op_type == "DequantizeLinear":
        out = users[0].output[0]
    else:
        attrs["requantize"] = (node.input[6], node.input[7])
    return xf, out, attrs


def insert_points(model: onnx.ModelProto, scope: str = "linear") -> dict[str, Target]:
    """Add LoRA insertion points to `model` in place; returns the targets by module path.

    Modules reached by several nodes (a module called twice) share one A/B pair, as the LoRA does.
    Already-rewritten graphs are refused (the inputs would be doubled)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    graph = model.graph
    if any(i.name.endswith(A_SUFFIX) for i in graph.input):
        raise ValueError("the graph already has LoRA insertion points")
    g = _Graph(graph)
    targets: dict[str, Target] = {}
    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # index of the node the branch goes after -> nodes
    index = {id(n): i for i, n in enumerate(graph.node)}
    for node in list(graph.node):
        module = module_path(node.name)
        if module is None:
            continue
        plan = _plan(g, node, scope)
        if plan is None:
            continue
        (op, k, n, kernel), x, out, attrs = plan
        requant, deq = attrs.pop("requantize", None), attrs.pop("dequantize", None)
        target = Target(module, op, k, n, kernel)
        if targets.setdefault(module, target) != target:
            continue  # one module path, two shapes: not a layer a LoRA can name
        a, b = module + A_SUFFIX, module + B_SUFFIX
        tag = f"/lora/{module}/{len(new_nodes)}"
        if a not in g.inits:
            _add_input(graph, g, a, b, target)
        base = out + "/base"
        producer = g.producer[out]
        for i, o in enumerate(producer.output):
            if o == out:
                producer.output[i] = base
        if op == "linear":
            branch = [helper.make_node("MatMul", [x, a], [tag + "/down"], name=tag + "/MatMul"),
                      helper.make_node("MatMul", [tag + "/down", b], [tag + "/up"], name=tag + "/MatMul_1")]
        elif _pointwise(kernel, attrs):
            branch = _pointwise_branch(graph, g, x, a, b, base, tag)
        else:
            branch = [helper.make_node("Conv", [x, a], [tag + "/down"], name=tag + "/Conv", **attrs),
                      helper.make_node("Conv", [tag + "/down", b], [tag + "/up"], name=tag + "/Conv_1")]
        if _is_half(g, node):  # an fp16 layer: the fed float32 A/B are cast to its type
            branch.insert(0, helper.make_node("Cast", [a], [tag + "/A16"], name=tag + "/CastA", to=TensorProto.FLOAT16))
            branch.insert(1, helper.make_node("Cast", [b], [tag + "/B16"], name=tag + "/CastB", to=TensorProto.FLOAT16))
            for nd in branch[2:]:
                nd.input[:] = [{a: tag + "/A16", b: tag + "/B16"}.get(v, v) for v in nd.input]
        if deq is not None:
            branch[0].input[0] = tag + "/xf"
            branch.insert(0, helper.make_node("DequantizeLinear", [v for v in deq if v] if not deq[2] else list(deq),
                                              [tag + "/xf"], name=tag + "/DQx"))
        if requant is None:
            branch.append(helper.make_node("Add", [base, tag + "/up"], [out], name=tag + "/Add"))
        else:  # Q(DQ(y) + 0) == y: the rounding to the same scale gives the integer back
            branch += [helper.make_node("DequantizeLinear", [base, *requant], [tag + "/yf"], name=tag + "/DQ"),
                       helper.make_node("Add", [tag + "/yf", tag + "/up"], [tag + "/sum"], name=tag + "/Add"),
                       helper.make_node("QuantizeLinear", [tag + "/sum", *requant], [out], name=tag + "/Q")]
        new_nodes.setdefault(index[id(producer)], []).extend(branch)
    nodes = []
    for i, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(new_nodes.get(i, []))
    del graph.node[:]
    graph.node.extend(nodes)
    return targets


def _pointwise(kernel: tuple[int, ...], attrs: dict) -> bool:
    """A 1x1 conv with unit strides and dilations and no padding: a matrix product over the channels."""
    return (kernel == (1, 1) and all(v == 1 for v in attrs.get("strides", [1]))
            and all(v == 1 for v in attrs.get("dilations", [1])) and not any(attrs.get("pads", [0])))


def _pointwise_branch(graph: onnx.GraphProto, g: _Graph, x: str, a: str, b: str, base: str, tag: str) -> list:
    """(B (A x)) over the channels of a 1x1 conv's input as two MatMuls on [batch, channels, h*w]: ORT's Conv with
    a fed (non-constant) weight was slower on int8 folders (shapes-sd: 4-5 points of the step with and without an
    adapter, experiments/lora/overhead.md; fp32 unchanged); a MatMul with an empty side only writes zeros. A and B keep the conv
    layouts ([r, in, 1, 1], [out, r, 1, 1]): Flatten makes [r, in] / [out, r] views of them (r = 0 included)."""
    flat = "/lora/flat_hw"
    if flat not in g.inits:
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), flat))
        g.inits[flat] = graph.initializer[-1]
    return [helper.make_node("Reshape", [x, flat], [tag + "/x3"], name=tag + "/Reshape"),
            helper.make_node("Flatten", [a], [tag + "/A2"], name=tag + "/FlattenA", axis=1),
            helper.make_node("Flatten", [b], [tag + "/B2"], name=tag + "/FlattenB", axis=1),
            helper.make_node("MatMul", [tag + "/A2", tag + "/x3"], [tag + "/down"], name=tag + "/MatMul"),
            helper.make_node("MatMul", [tag + "/B2", tag + "/down"], [tag + "/up3"], name=tag + "/MatMul_1"),
            helper.make_node("Shape", [base], [tag + "/shape"], name=tag + "/Shape"),
            helper.make_node("Reshape", [tag + "/up3", tag + "/shape"], [tag + "/up"], name=tag + "/Reshape_1")]


def _is_half(g: _Graph, node: onnx.NodeProto) -> bool:
    w = node.input[1] if node.op_type in ("MatMul", "Gemm", "Conv") else None
    return w in g.inits and g.inits[w].data_type == TensorProto.FLOAT16


def _add_input(graph: onnx.GraphProto, g: _Graph, a: str, b: str, t: Target) -> None:
    """A and B as graph inputs with rank-0 defaults (an input with an initializer may be fed or left)."""
    i = len([v for v in graph.input if v.name.endswith(A_SUFFIX)])
    r = f"lora_rank_{i}"
    if t.op == "linear":
        shapes = ([t.in_features, r], [r, t.out_features])
        empty = (np.zeros((t.in_features, 0), np.float32), np.zeros((0, t.out_features), np.float32))
    else:
        shapes = ([r, t.in_features, *t.kernel], [t.out_features, r, 1, 1])
        empty = (np.zeros((0, t.in_features, *t.kernel), np.float32), np.zeros((t.out_features, 0, 1, 1), np.float32))
    for name, shape, value in zip((a, b), shapes, empty):
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        graph.initializer.append(numpy_helper.from_array(value, name))
        g.inits[name] = graph.initializer[-1]


def targets_from_manifest(entry: Component) -> dict[str, Target]:
    return {m: Target.from_dict(m, d) for m, d in (entry.lora_targets or {}).items()}
