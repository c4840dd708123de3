"""Graph order and liveness: nodes in dependency order, the nodes a graph's outputs need, dead ones dropped.

Shared by the quantizer's graph rewrites and the runtime's (runtime/dead_queries.py). Pure `onnx`.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds in its attributes (If branches, a Loop body)."""
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def toposort(graph: onnx.GraphProto, outer: Iterable[str] = ()) -> list[onnx.NodeProto]:
    """Nodes in dependency order (quantizers append Q/DQ nodes at the end; subgraphs must be sorted)."""
    avail = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""} | set(outer)
    producers = {o for n in graph.node for o in n.output}
    pending, out = list(graph.node), []
    while pending:
        rest = []
        for n in pending:
            if all(x in avail or x not in producers for x in n.input):
                out.append(n)
                avail.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError(f"graph {graph.name!r} has a cycle through {rest[0].name!r}")
        pending = rest
    return out


def sort_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Put the nodes in dependency order in place (ORT's tools append new nodes at the end; a graph
    inlined into a Loop body or If branch must be sorted)."""
    ordered = toposort(model.graph)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return model


def live_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes the graph's outputs need (subgraphs' outer-scope reads included), in topological order."""
    live = {o.name for o in graph.output}
    keep = []
    for n in reversed(toposort(graph)):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(n.input)
            for sub in subgraphs(n):
                live.update(outer_reads(sub))
    keep.reverse()  # topological order, as subgraphs (If, Loop bodies) require
    return keep


def remove_dead_nodes(model: onnx.ModelProto) -> None:
    g = model.graph
    keep = live_nodes(g)
    del g.node[:]
    g.node.extend(keep)
    used = {o.name for o in g.output}
    for n in g.node:
        used.update(n.input)
        for sub in subgraphs(n):
            used.update(outer_reads(sub))
    inits = [t for t in g.initializer if t.name in used]
    if len(inits) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(inits)


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    reads = set()
    for n in graph.node:
        reads.update(x for x in n.input if x and x not in local)
        for sub in subgraphs(n):
            reads.update(x for x in outer_reads(sub) if x not in local)
    reads.update(o.name for o in graph.output if o.name not in local)
    return reads
