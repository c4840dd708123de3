"""Cut an exported backbone ONNX graph in three by node names, for step caching.

Step caching skips a middle span of the backbone on some steps: the transformer blocks after the
first (first-block cache, TaylorSeer) or a UNet's deep path (DeepCache).  The family names that
span by node-name prefixes (torch's exporter names nodes after module paths, e.g.
``/model/transformer_blocks.3/attn/...``); this module turns one ONNX graph into

  first: the graph inputs -> every tensor the span reads (its inputs) + the probes a policy needs
  rest:  the span: its inputs -> every tensor it produces that is read outside it
  tail:  the span's outputs + whatever else the tail reads -> the graph's outputs

Running first -> rest -> tail computes what the whole graph computes (a test checks it), and a
cached step runs first -> tail with stored (or extrapolated) span outputs.  Works on any folder
already exported, in memory, at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper


@dataclass
class SplitGraphs:
    first: onnx.ModelProto
    rest: onnx.ModelProto
    tail: onnx.ModelProto
    span_inputs: list[str]  # what rest reads (first's outputs, in order)
    span_outputs: list[str]  # what rest gives (tail reads them)
    tail_from_first: list[str]  # first's outputs the tail also reads (not span outputs)
    hidden_in: list[str]  # candidates for the span's hidden-state input (= the first block's output)
    hidden_out: str | None  # the span's hidden-state output
    probe: list[str]  # candidates for the first block's hidden input (its residual = hidden_in - probe)


def _producers(graph) -> dict[str, int]:
    return {o: i for i, n in enumerate(graph.node) for o in n.output if o}


def _backward(graph, targets: list[str], stop: set[str], values: bool = False) -> tuple[list[int], set[str]]:
    """Node indices needed for `targets` when tensors in `stop` are given; and the stop tensors reached
    (`values`: through the tensors' values only, not into what Shape / Size read)."""
    prod = _producers(graph)
    inits = {i.name for i in graph.initializer}
    need, reached, seen = set(), set(), set()
    todo = list(targets)
    while todo:
        t = todo.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        if t in stop:
            reached.add(t)
            continue
        if t in inits or t not in prod:
            if t not in inits:
                reached.add(t)  # a graph input
            continue
        i = prod[t]
        if i not in need:
            need.add(i)
            if values and graph.node[i].op_type in _SHAPE_OPS:
                continue
            todo.extend(graph.node[i].input)
            for attr in graph.node[i].attribute:  # subgraph outer-scope reads
                if attr.g is not None:
                    for sn in attr.g.node:
                        todo.extend(sn.input)
    return sorted(need), reached


_SHAPE_OPS = {"Shape", "Size"}


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - contrib ops inferred partially: fall back to float below
        inferred = model
    g = inferred.graph
    types = {v.name: v.type for v in [*g.input, *g.output, *g.value_info]}
    return _fill_types(model.graph, types)


# output zero point's input index of ONNX Runtime's fused integer ops (a quantized folder's graph is saved after
# its optimizer ran: QLinearConv, QGemm, QLinearAdd ... whose outputs ONNX's shape inference leaves untyped)
_ZP_INPUT = {"QuantizeLinear": 2, "QLinearConv": 7, "QLinearMatMul": 7, "QLinearAdd": 7, "QLinearMul": 7,
             "QGemm": 8, "QLinearConcat": 1, "QLinearSigmoid": 4, "QLinearLeakyRelu": 4, "QLinearSoftmax": 4,
             "QLinearAveragePool": 4, "QLinearGlobalAveragePool": 4}
_FLOAT_OUT = {"DequantizeLinear", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}
_INT64_OUT = {"Shape", "Size", "ArgMax", "ArgMin", "NonZero"}
_BOOL_OUT = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN"}


def _fill_types(graph, types: dict[str, onnx.TypeProto]) -> dict[str, onnx.TypeProto]:
    """Element types for the tensors shape inference left untyped, from their producers (in graph order):
    quantized ops give their output zero point's type, the rest mostly their first input's."""
    elem = {n: t.tensor_type.elem_type for n, t in types.items() if t.tensor_type.elem_type}
    elem.update({i.name: i.data_type for i in graph.initializer})
    for node in graph.node:
        op, ins = node.op_type, list(node.input)
        if op in _ZP_INPUT:
            k = _ZP_INPUT[op]
            quantized = op != "QGemm" or (len(ins) > 7 and ins[7])
            out = (elem.get(ins[k], onnx.TensorProto.UINT8) if len(ins) > k and ins[k] else onnx.TensorProto.UINT8) \
                if quantized else onnx.TensorProto.FLOAT
        elif op in _FLOAT_OUT:
            out = onnx.TensorProto.FLOAT
        elif op in _INT64_OUT:
            out = onnx.TensorProto.INT64
        elif op in _BOOL_OUT:
            out = onnx.TensorProto.BOOL
        elif op == "Cast":
            out = next(a.i for a in node.attribute if a.name == "to")
        else:
            src = ins[1] if op == "Where" else ins[0] if ins else ""
            out = elem.get(src, onnx.TensorProto.FLOAT)
        outs = [onnx.TensorProto.UINT8, onnx.TensorProto.FLOAT, onnx.TensorProto.UINT8] \
            if op == "DynamicQuantizeLinear" else [out] * len(node.output)
        for o, e in zip(node.output, outs):
            if o and o not in elem:
                elem[o] = e
    filled = dict(types)
    for name, e in elem.items():
        if name not in filled or not filled[name].tensor_type.elem_type:
            t = onnx.TypeProto()
            t.tensor_type.elem_type = e
            filled[name] = t
    return filled


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    t = types.get(name)
    if t is not None and t.tensor_type.elem_type:
        vi = onnx.ValueInfoProto()
        vi.name = name
        vi.type.tensor_type.elem_type = t.tensor_type.elem_type  # shapes: left to ONNX Runtime
        return vi
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)


def _sub(model: onnx.ModelProto, nodes: list[int], inputs: list[str], outputs: list[str],
         types: dict[str, onnx.TypeProto], name: str) -> onnx.ModelProto:
    g = model.graph
    used = {t for i in nodes for t in g.node[i].input}
    for i in nodes:
        for attr in g.node[i].attribute:
            if attr.g is not None:
                used |= {t for sn in attr.g.node for t in sn.input}
    graph = helper.make_graph(
        [g.node[i] for i in nodes], name,
        [_value_info(n, types) for n in inputs], [_value_info(n, types) for n in outputs],
        [init for init in g.initializer if init.name in used])
    sub = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return sub


def split(model: onnx.ModelProto, span_prefixes: tuple[str, ...], probe_prefix: str | None = None,
          sample: str = "sample") -> SplitGraphs:
    """Cut `model` around the nodes whose names start with one of `span_prefixes`.

    Only the span outputs that depend on the `sample` input are cached (rest's outputs); others read
    outside the span (a timestep embedding the tail shares) are recomputed by the tail, so a cached
    step never reuses a stale function of the timestep.

    `probe_prefix`: the first block's node prefix; its hidden-state input becomes an extra output of
    `first` (first-block cache compares that block's residual across steps).
    """
    g = model.graph
    if any(init.data_location == onnx.TensorProto.EXTERNAL for init in g.initializer):
        raise ValueError("step caching splits the backbone in memory: load it with its external data")
    span = [i for i, n in enumerate(g.node) if n.name.startswith(span_prefixes)]
    if not span:
        raise ValueError(f"the backbone has no nodes named {span_prefixes[0]}...: it cannot be split for caching")
    # nodes ORT's optimizer adds without a module name (NCHWc reorders, reshapes) between two span nodes:
    # left outside, they would feed the span from a piece that runs after it (before the constants below,
    # which a node outside may share)
    in_span = set(span) | _sandwiched(g, set(span))
    span = sorted(in_span)
    made = {o for i in span for o in g.node[i].output}
    inits = {i.name for i in g.initializer}
    # constants without inputs the span reads are copied into it rather than passed in
    prod = _producers(g)
    for i in list(span):
        for t in g.node[i].input:
            j = prod.get(t)
            if j is not None and j not in in_span and not g.node[j].input and g.node[j].op_type == "Constant":
                in_span.add(j)
                made.add(t)
    span = sorted(in_span)
    reads = [t for i in span for t in g.node[i].input if t and t not in made and t not in inits]
    span_inputs = list(dict.fromkeys(reads))
    outside_reads = {t for i, n in enumerate(g.node) if i not in in_span for t in n.input}
    graph_outs = [o.name for o in g.output]
    read_outside = [t for i in span for t in g.node[i].output if t in outside_reads or t in graph_outs]
    # a timestep embedding reads the sample's batch size only (Shape): not a value to cache
    span_outputs = [t for t in read_outside if sample in _backward(g, [t], set(), values=True)[1]]
    graph_inputs = [i.name for i in g.input if i.name not in inits]
    types = _types(model)

    hidden_in: list[str] = []
    probe: list[str] = []
    hidden_out = None
    if probe_prefix is not None:
        # the residual stream: Adds carry the hidden state through each pre-norm block (x + gate * attn(...));
        # joint blocks move it through Concat/Slice.  Following it backward pairs the span's output with the
        # span inputs it continues (the first block's outputs), and those with the first block's own inputs;
        # which candidate has the output's shape is settled at run time (CachedBackbone)
        for out in span_outputs:
            hidden_in = _stream_origins(g, out, set(span_inputs))
            if hidden_in:
                hidden_out = out
                break
        if not hidden_in:
            raise ValueError("cannot find the hidden-state stream through the backbone's blocks")
        block = [i for i, n in enumerate(g.node) if n.name.startswith(probe_prefix)]
        block_made = {o for i in block for o in g.node[i].output}
        block_reads = {t for i in block for t in g.node[i].input if t and t not in block_made}
        # the image stream's first-block input comes from the sample without any block (the patch
        # embedding); the text stream's from the text encoder states: that tells a joint block's two apart
        pairs = [(h, p) for h in hidden_in for p in _stream_origins(g, h, block_reads)
                 if sample in _backward(g, [p], set())[1]]
        if not pairs:
            raise ValueError("cannot find the first block's hidden-state input")
        hidden_in, probe = [pairs[0][0]], [pairs[0][1]]

    first_outs = list(dict.fromkeys(span_inputs + probe))
    f_nodes, _ = _backward(g, first_outs, set())
    # what `first` computes anyway (a shallow block's skip feature) the tail reads from it, not recomputed
    by_first = {o: i for i in f_nodes for o in g.node[i].output if o}
    t_nodes, t_reads = _backward(g, graph_outs, set(span_outputs) | set(first_outs) | set(by_first))
    first_outs += sorted((t for t in t_reads if t in by_first and t not in first_outs), key=by_first.get)
    if len(set(t_nodes) & in_span) > 0.5 * len(span):
        raise ValueError("the backbone's tail reads the cached span through more than its hidden state")
    tail_from_first = [t for t in first_outs if t in t_reads and t not in span_outputs]
    tail_graph_inputs = [t for t in graph_inputs if t in t_reads]
    # the tail may read graph inputs (Shape of the sample) too: those are given from the call's feeds
    tail_inputs = list(dict.fromkeys([t for t in span_outputs if t in t_reads] + tail_from_first + tail_graph_inputs))
    first = _sub(model, f_nodes, graph_inputs, first_outs, types, "cache_first")
    rest = _sub(model, span, span_inputs, span_outputs, types, "cache_rest")
    tail = _sub(model, t_nodes, tail_inputs, graph_outs, types, "cache_tail")
    return SplitGraphs(first, rest, tail, span_inputs, span_outputs, tail_from_first + tail_graph_inputs,
                       hidden_in, hidden_out, probe)


def pruned(model: onnx.ModelProto, outputs: list[str], name: str) -> onnx.ModelProto:
    """`model` computing only `outputs`: the nodes they need, the graph inputs those read (ONNX Runtime runs
    every node of a session, whatever outputs a call asks for)."""
    g = model.graph
    nodes, reached = _backward(g, outputs, set())
    return _sub(model, nodes, [i.name for i in g.input if i.name in reached], outputs, _types(model), name)


def _sandwiched(g, span: set[int]) -> set[int]:
    """Nodes outside `span` that depend on a span node and feed one."""
    prod = _producers(g)
    users: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for t in n.input:
            users.setdefault(t, []).append(i)

    def reach(step) -> set[int]:
        seen, todo = set(), list(span)
        while todo:
            for j in step(todo.pop()):
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen

    down = reach(lambda i: [j for t in g.node[i].output for j in users.get(t, [])])
    up = reach(lambda i: [prod[t] for t in g.node[i].input if t in prod])
    return (down & up) - span


_STREAM_OPS = {"Add": None, "Concat": None, "Slice": 1, "Split": 1}  # op -> how many leading inputs carry data


def _stream_origins(g, tensor: str, stop: set[str]) -> list[str]:
    """The tensors in `stop` that `tensor` is reached from through the residual stream's ops alone."""
    prod = _producers(g)
    todo, seen, found = [tensor], set(), []
    while todo:
        t = todo.pop(0)
        if t in stop:
            if t not in found:
                found.append(t)
            continue
        if t in seen or t not in prod:
            continue
        seen.add(t)
        node = g.node[prod[t]]
        if node.op_type in _STREAM_OPS:
            k = _STREAM_OPS[node.op_type]
            todo.extend(node.input if k is None else node.input[:k])
    return found


def run_whole(first, rest, tail, sg: SplitGraphs, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """first -> rest -> tail on sessions (what the whole graph computes): the twin a test compares."""
    names = [o.name for o in first.get_outputs()]
    f = dict(zip(names, first.run(None, {i.name: feeds[i.name] for i in first.get_inputs()})))
    r = dict(zip(sg.span_outputs, rest.run(None, {n: f[n] for n in sg.span_inputs})))
    return tail.run(None, {i.name: {**feeds, **f, **r}[i.name] for i in tail.get_inputs()})[0]
