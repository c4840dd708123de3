"""Timestep groups as one graph: K per-group backbones behind `If` switches on the step's timestep."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..loopgraph.builder import rename_outer_refs
from ..onnxio.group_names import branch_node_name, branch_tag, switch_name
from .graphs import tensor_key, toposort

BACKBONE_INPUTS = ("sample", "timestep", "encoder_hidden_states")


def merge_timestep_groups(models: list[onnx.ModelProto], boundaries: list[float],
                          output: str = "out_sample") -> onnx.ModelProto:
    """One backbone that runs group k's graph when the step's timestep falls in group k.

    `models` are the K per-group graphs (same inputs/outputs), ordered from the noisiest group
    (highest t) down; `boundaries` (K-1, descending): group k runs while t >= boundaries[k]
    and t < boundaries[k-1]. The switch is a chain of `If` nodes on t = max(timestep); each
    branch is one group's graph with its intermediate names shortened (node names keep their module path behind
    the group's prefix: step caching cuts each branch by it). Initializers that are byte-identical in every
    group (the quantized weights) are stored once, in the outer graph; branches hold only their own scales,
    zero points and int32 biases.
    """
    k = len(models)
    if k < 2 or len(boundaries) != k - 1:
        raise ValueError(f"need K >= 2 models and K-1 boundaries, got {k} and {len(boundaries)}")
    if any(b1 <= b2 for b1, b2 in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be strictly descending, got {boundaries}")
    ref = models[0]
    keyed = [{t.name: tensor_key(t) for t in m.graph.initializer} for m in models]
    shared = {name for name, key in keyed[0].items() if all(kd.get(name) == key for kd in keyed[1:])}
    outer_inits = [t for t in ref.graph.initializer if t.name in shared]
    # graph inputs are read through Identity nodes so that a caller inlining this graph can
    # rebind them (samplers.graph remaps node inputs, including inside subgraphs)
    io = {x: f"groups/{x}" for x in BACKBONE_INPUTS}
    nodes = [helper.make_node("Identity", [x], [io[x]], name=f"groups/{x}") for x in BACKBONE_INPUTS]
    nodes.append(helper.make_node("ReduceMax", ["timestep"], ["groups/t"], name="groups/t", keepdims=0))
    inits = list(outer_inits)
    for j, b in enumerate(boundaries):
        inits.append(numpy_helper.from_array(np.array(b, np.float32), f"groups/bound{j}"))
        nodes.append(helper.make_node("GreaterOrEqual", ["groups/t", f"groups/bound{j}"], [f"groups/in{j}"],
                                      name=f"groups/in{j}"))
    branches = [_branch(m, j, shared, io, output) for j, m in enumerate(models)]
    nodes.extend(_switch_chain(branches, output, inits))
    graph = helper.make_graph(nodes, ref.graph.name + "_timestep_groups", list(ref.graph.input), list(ref.graph.output),
                              initializer=inits)
    merged = helper.make_model(graph, opset_imports=list(ref.opset_import), producer_name="onnxdiffusion")
    merged.ir_version = ref.ir_version
    return merged


def _switch_chain(branches: list[onnx.GraphProto], output: str, inits: list) -> list[onnx.NodeProto]:
    """K sibling If nodes, each running its group's graph or passing the previous result along.

    Every If sits in the top-level graph: ONNX Runtime pre-packs the outer-scope weights of
    integer convolutions only one subgraph level deep, so nested Ifs (a chain or a tree) ran
    QLinearConv ~2.7x slower for groups below the first level.
    """
    k = len(branches)
    nodes = []
    inits.append(numpy_helper.from_array(np.zeros((1,), np.float32), "groups/none"))
    sel = []
    for j in range(k):
        if j == 0:
            sel.append("groups/in0")
            continue
        not_prev = nodes_add(nodes, "Not", [f"groups/in{j - 1}"], f"groups/out_of{j - 1}")
        if j == k - 1:
            sel.append(not_prev)
        else:
            sel.append(nodes_add(nodes, "And", [not_prev, f"groups/in{j}"], f"groups/sel{j}"))
    prev = "groups/none"
    for j in range(k):
        out = output if j == k - 1 else f"groups/out{j}"
        passthrough = helper.make_graph([helper.make_node("Identity", [prev], [f"groups/pass{j}"], name=f"groups/pass{j}")],
                                        f"groups_pass{j}", [],
                                        [helper.make_tensor_value_info(f"groups/pass{j}", TensorProto.FLOAT, None)])
        nodes.append(helper.make_node("If", [sel[j]], [out], name=switch_name(j), then_branch=branches[j],
                                      else_branch=passthrough))
        prev = out
    return nodes


def nodes_add(nodes: list, op: str, inputs: list[str], out: str) -> str:
    nodes.append(helper.make_node(op, inputs, [out], name=out))
    return out


def _branch(model: onnx.ModelProto, j: int, shared: set[str], io: dict[str, str], output: str) -> onnx.GraphProto:
    """Group j's graph as an If branch: local names shortened to g{j}/{n}, outer names kept."""
    g = model.graph
    local_inits = [t for t in g.initializer if t.name not in shared]
    ordered = toposort(g)
    names: dict[str, str] = {}

    def local(x: str) -> str:
        if x not in names:
            names[x] = f"{branch_tag(j)}/{len(names)}"
        return names[x]

    for t in local_inits:
        local(t.name)
    for n in ordered:
        for o in n.output:
            if o:
                local(o)

    def rename(x: str) -> str:
        if not x:
            return x
        if x in io:
            return io[x]
        return names.get(x, x)

    nodes = []
    for i, n in enumerate(ordered):
        new = onnx.NodeProto()
        new.CopyFrom(n)
        del new.input[:]
        del new.output[:]
        new.input.extend(rename(x) for x in n.input)
        new.output.extend(rename(x) for x in n.output)
        # the module path stays in the name (behind the group's prefix): step caching cuts each branch by it
        new.name = branch_node_name(j, n.name, i)
        new.doc_string = ""
        rename_outer_refs(new, rename)
        nodes.append(new)
    inits = []
    for t in local_inits:
        c = onnx.TensorProto()
        c.CopyFrom(t)
        c.name = names[t.name]
        inits.append(c)
    out = helper.make_tensor_value_info(rename(output), TensorProto.FLOAT, None)
    return helper.make_graph(nodes, f"group{j}", [], [out], initializer=inits)
