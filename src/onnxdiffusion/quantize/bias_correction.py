"""Empirical bias correction of int8 linears (Nagel et al. 2019, "Data-Free Quantization"; NNCF's
fast bias correction): the mean per-output-channel error each quantized linear adds is folded into its bias.

    model, details = correct_biases(fp32, quantize, nodes, calib)

A per-channel error that is the same at every token / pixel (the weights' rounding error times
the input's channel means, plus the activations' rounding bias) is a purely low-frequency error.
For each quantized linear, its int8 twin (the quantized graph's Q/DQ of its inputs and the linear
itself) is fed the fp32 graph's own activations, and the per-channel mean of twin minus original
over every calibration step, row and position is subtracted from the linear's bias in the fp32
graph (a bias is added where the linear has none); the caller quantizes the corrected graph.
Measured alone, each linear corrects only its own error, so the corrections add up without
overshooting (measuring the whole quantized graph's error at every linear and correcting all at
once over-corrected: the upstream error is counted again at each linear downstream).
Means are reduced inside the graph (ReduceMean per tensor), so a call returns a few numbers per
linear. Pure `onnx` + numpy around ORT sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import files
from .stats import default_opset, replace_outputs

CHUNK = 16  # calibration rows per session call


@dataclass(frozen=True)
class Target:
    """A quantized linear: its output `tensor` (before any separate bias Add), channels on `axis`."""

    node: str
    tensor: str
    axis: int
    rank: int
    bias: str | None  # the bias initializer (Conv / Gemm input 2, or the Add after a MatMul); None: none


def targets(model: onnx.ModelProto, nodes: Sequence[str]) -> list[Target]:
    """Each named Conv / MatMul / Gemm with a constant weight, in graph order (`model` shape-inferred)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    rank = {v.name: len(v.type.tensor_type.shape.dim) for v in list(g.value_info) + list(g.output)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    wanted = set(nodes)
    out = []
    for n in g.node:
        if n.name not in wanted or n.op_type not in ("Conv", "MatMul", "Gemm") or n.input[1] not in inits:
            continue
        y = n.output[0]
        if y not in rank:
            raise ValueError(f"bias correction: no shape for {n.name}'s output (run shape inference first)")
        if n.op_type in ("Conv", "Gemm"):
            bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
            out.append(Target(n.name, y, 1 if n.op_type == "Conv" else -1, rank[y], bias))
            continue
        bias, reads = None, readers.get(y, [])
        if len(reads) == 1 and y not in outputs and reads[0].op_type == "Add":
            other = reads[0].input[1] if reads[0].input[0] == y else reads[0].input[0]
            t = inits.get(other)
            if t is not None and t.data_type == TensorProto.FLOAT and list(t.dims) == [int(inits[n.input[1]].dims[-1])]:
                bias = other
        out.append(Target(n.name, y, -1, rank[y], bias))
    return out


def mean_model(model: onnx.ModelProto, probes: Sequence[tuple[str, int, int]]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy whose outputs are each probe tensor's per-channel mean over every other axis:
    probes (tensor, channel axis, rank) -> outputs (channels,) in the same order; each mean runs right
    after its tensor is made (stats.replace_outputs, as the calibration statistics do)."""
    out = files.copy(model)
    new_opset = default_opset(out) >= 18  # ReduceMean's axes: an input from opset 18, an attribute before
    names, chains = [], []
    for i, (tensor, axis, rank) in enumerate(probes):
        axes = [a for a in range(rank) if a != axis % rank]
        name = f"channel_mean/{i}"
        if new_opset:
            out.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), f"{name}/axes"))
            node = helper.make_node("ReduceMean", [tensor, f"{name}/axes"], [name], name=name, keepdims=0)
        else:
            node = helper.make_node("ReduceMean", [tensor], [name], name=name, axes=axes, keepdims=0)
        chains.append((tensor, [node]))
        names.append(name)
    replace_outputs(out, chains, names)
    return out, names


def channel_means(model: onnx.ModelProto, probes: Sequence[tuple[str, int, int]], calib, threads: int = 1) -> list[np.ndarray]:
    """Per-channel mean of each probe tensor over every calibration step, row and position (float64)."""
    from .runner import session

    graph, names = mean_model(model, probes)
    sess = session(graph, threads, stats=True)
    sums, rows = [0.0] * len(names), 0
    for _, feed in calib.feeds(chunk=CHUNK):
        n = len(feed["sample"])
        for i, v in enumerate(sess.run(names, feed)):
            sums[i] = sums[i] + n * v.astype(np.float64)  # equal positions per row: a row-weighted mean
        rows += n
    return [s / rows for s in sums]


def local_graph(fp32: onnx.ModelProto, qdq: onnx.ModelProto, nodes: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """`fp32` plus, for each named linear, its int8 twin fed by the fp32 activations: the quantized
    graph's Q/DQ chains into the linear and the linear itself, copied under fresh names.
    Returns the graph and node -> twin output."""
    from .graphs import sort_graph

    out = files.copy(fp32)
    g = out.graph
    have = {t.name for t in g.initializer}
    q_inits = {t.name: t for t in qdq.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    by_name = {n.name: n for n in qdq.graph.node}
    twins: dict[str, str] = {}
    for name in nodes:
        node = by_name.get(name)
        if node is None:
            raise ValueError(f"bias correction: {name} is not in the quantized graph")
        made: list[onnx.NodeProto] = []

        def take(x: str, depth: int = 0) -> str:
            """x in the twin: Q/DQ chains copied, initializers carried over, any other tensor the fp32 one."""
            if x in q_inits:
                if x not in have:
                    g.initializer.append(q_inits[x])
                    have.add(x)
                return x
            p = producer.get(x)
            if p is None or p.op_type not in ("QuantizeLinear", "DequantizeLinear") or depth > 2:
                return x
            ins = [take(i, depth + 1) if i else i for i in p.input]
            made.append(_renamed(p, f"{name}/twin/{len(made)}", ins))
            return made[-1].output[0]

        twin = _renamed(node, f"{name}/twin", [take(i) if i else i for i in node.input])
        g.node.extend(made + [twin])
        twins[name] = twin.output[0]
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, default_opset(qdq))
    return sort_graph(out), twins


def _renamed(node: onnx.NodeProto, name: str, inputs: list[str]) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = name
    del copy.input[:]
    copy.input.extend(inputs)
    del copy.output[:]
    copy.output.append(f"{name}/out")
    return copy


def local_errors(fp32: onnx.ModelProto, qdq: onnx.ModelProto, tgts: Sequence[Target], calib, threads: int = 1) -> dict[str, np.ndarray]:
    """node -> (channels,): the mean per-channel error each linear adds alone (its int8 twin minus
    itself, both fed the fp32 activations) over the calibration feeds."""
    graph, twins = local_graph(fp32, qdq, [t.node for t in tgts])
    probes = [p for t in tgts for p in ((t.tensor, t.axis, t.rank), (twins[t.node], t.axis, t.rank))]
    means = channel_means(graph, probes, calib, threads)
    return {t.node: means[2 * i + 1] - means[2 * i] for i, t in enumerate(tgts)}


def with_biases(model: onnx.ModelProto, tgts: Sequence[Target], shift: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy whose linears' biases are `bias - shift[node]`; a linear without a bias gets one
    (Conv / Gemm: input 2; MatMul: an Add after it, which takes over the MatMul's output name)."""
    out = files.copy(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes = {n.name: n for n in g.node}
    added = []
    for t in tgts:
        if t.node not in shift:
            continue
        d = np.asarray(shift[t.node], np.float64)
        if t.bias is not None:
            b = inits[t.bias]
            b.CopyFrom(numpy_helper.from_array((files.array(out, b).astype(np.float64) - d).astype(np.float32), t.bias))
            continue
        name = f"{t.node}/corrected_bias"
        g.initializer.append(numpy_helper.from_array((-d).astype(np.float32), name))
        n = nodes[t.node]
        if n.op_type in ("Conv", "Gemm"):
            while len(n.input) < 3:
                n.input.append("")
            n.input[2] = name
            continue
        n.output[0] = f"{t.tensor}/before_bias"
        added.append((n, helper.make_node("Add", [n.output[0], name], [t.tensor], name=f"{t.node}/bias_add")))
    for n, add in added:
        g.node.insert(list(g.node).index(n) + 1, add)
    return out


def correct_biases(model: onnx.ModelProto, quantize: Callable[[onnx.ModelProto], onnx.ModelProto], nodes: Sequence[str],
                   calib, threads: int = 1, log=None) -> tuple[onnx.ModelProto, dict]:
    """(`model` with the named linears' biases corrected, shape-inferred; details). `quantize(m)`
    makes the quantized graph of a float graph `m` (the correction is measured on quantize(model))."""
    log = log or (lambda m: None)
    tgts = targets(model, nodes)
    err = local_errors(model, quantize(model), tgts, calib, threads)
    corrected = files.infer_shapes(with_biases(model, tgts, err))
    rms = float(np.sqrt(np.mean(np.concatenate([e**2 for e in err.values()])))) if err else 0.0
    top = sorted(err, key=lambda k: -float(np.sqrt(np.mean(err[k] ** 2))))[:5]
    log(f"bias correction: {len(tgts)} linears, rms per-channel mean error {rms:.3g} folded into their biases")
    return corrected, {"corrected_linears": len(tgts), "added_biases": sum(t.bias is None for t in tgts),
                       "rms_channel_mean_error": rms,
                       "largest": [{"node": k, "rms": float(np.sqrt(np.mean(err[k] ** 2)))} for k in top]}
