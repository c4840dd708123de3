"""Step caching on a timestep-grouped backbone (int8-timestep: K group graphs behind sibling ``If`` switches on the
step's timestep, quantize/timestep_graphs.py): the switch is lifted out, each group's branch is cut like a plain
backbone (backbone_split.split), and each of the three pieces switches between its K cuts the way the backbone
switched between its groups.

The groups are one graph quantized with K sets of activation scales, so their cuts have the same structure; a
branch's local names are made the same in every group (from the structure: each node's name) so the K cuts share
their inputs and outputs. The first piece also computes the switch and hands its conditions on (the rest and the
tail read them). A quantized (uint8) span output is handed on as float: DeepCache reuses the feature of one step at
later ones, which may fall in another group with other scales, so the rest dequantizes it with its own group's
scale and the tail quantizes it again with its own (a full step is bit-identical: the round trip of an integer is
exact).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..onnxio.group_names import branch_tag, switch_index
from .backbone_split import _ZP_INPUT as _ZP  # output zero point's input index (its scale is the one before)
from .backbone_split import SplitGraphs, split

LOCAL = "grp/"  # a branch's local names, the same in every group


def switches(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The group switches of a timestep-grouped backbone, in order (none: a plain backbone)."""
    ifs = [n for n in model.graph.node if n.op_type == "If" and switch_index(n.name) is not None]
    return sorted(ifs, key=lambda n: switch_index(n.name))


def _then(node: onnx.NodeProto) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == "then_branch")


def _node_name(name: str, j: int) -> str:
    """g{j}/model/... (a node's module path) -> /model/...; g{j}/nI (an unnamed node, I its place) -> grp/nI."""
    tag = branch_tag(j)
    rest = name[len(tag):] if name.startswith(tag + "/") else "/" + name
    return rest if rest.startswith("/model/") else LOCAL + rest[1:]


def _local_names(branch: onnx.GraphProto, j: int) -> dict[str, str]:
    """A branch's local tensor names -> names from the graph's structure (the same in every group, whose
    numbering of local names need not be): a node's output by the node's name, a local initializer by its first
    reader's."""
    names = {}
    for n in branch.node:
        node = _node_name(n.name, j)
        for k, o in enumerate(n.output):
            if o:
                names[o] = f"{LOCAL}{node}:{k}"
    own = {t.name for t in branch.initializer}
    for n in branch.node:
        for k, x in enumerate(n.input):
            if x in own and x not in names:
                names[x] = f"{LOCAL}{_node_name(n.name, j)}@{k}"
    return names


def branch_model(model: onnx.ModelProto, j: int) -> onnx.ModelProto:
    """Group j's graph as a plain backbone: the model's inputs and outputs, the switch's own nodes (which name the
    inputs the branches read), the branch's nodes with their local names made group-independent."""
    g = model.graph
    branch = _then(switches(model)[j])
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in branch.node for a in n.attribute):
        raise ValueError("a timestep group's graph holds subgraphs of its own: it cannot be cut for caching")
    names = _local_names(branch, j)
    nodes = [n for n in g.node if n.op_type != "If"]
    for n in branch.node:
        new = onnx.NodeProto()
        new.CopyFrom(n)
        new.name = _node_name(n.name, j)
        del new.input[:]
        del new.output[:]
        new.input.extend(names.get(x, x) for x in n.input)
        new.output.extend(names.get(x, x) for x in n.output)
        nodes.append(new)
    out = g.output[0].name
    nodes.append(helper.make_node("Identity", [names[branch.output[0].name]], [out], name=LOCAL + "out"))
    inits = []
    for t in branch.initializer:
        if t.name in names:  # (one no node reads is left out)
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = names[t.name]
            inits.append(c)
    reads = {x for n in nodes for x in n.input}
    inits += [t for t in g.initializer if t.name in reads]
    graph = helper.make_graph(nodes, f"{g.name}_group{j}", list(g.input), list(g.output), initializer=inits)
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def split_groups(model: onnx.ModelProto, span_of, sample: str = "sample") -> SplitGraphs:
    """The grouped backbone cut in three, each piece switching between its groups' cuts; `span_of(node_names)` ->
    (the span's node-name prefixes, the probe's prefix or None): the family's, read off each group's graph."""
    ifs = switches(model)
    conds = [n.input[0] for n in ifs]
    cuts = []
    for j in range(len(ifs)):
        m = branch_model(model, j)
        names = [n.name for n in m.graph.node]
        if not any(x.startswith("/model/") for x in names):
            raise ValueError("this timestep-grouped backbone's nodes carry no module names (quantized before they "
                             "were kept): quantize it again to cache it")
        span, probe_prefix = span_of(names)
        sg = split(m, span, probe_prefix, sample=sample)
        if sg.rest.graph.output[0].type.tensor_type.elem_type != TensorProto.FLOAT:
            sg = split(_float_span_output(m, sg, span[-1]), span, probe_prefix, sample=sample)
        cuts.append(sg)
    first = cuts[0]
    for sg in cuts[1:]:
        if _interface(sg) != _interface(first):
            raise ValueError("the timestep groups' graphs cut differently: they cannot share one cut")
    prologue = [n for n in model.graph.node if n.op_type != "If"]
    used = {x for n in prologue for x in n.input}
    prologue_inits = [t for t in model.graph.initializer if t.name in used]
    pieces = [_switched([sg.first for sg in cuts], conds, "cache_first", (prologue, prologue_inits)),
              _switched([sg.rest for sg in cuts], conds, "cache_rest"),
              _switched([sg.tail for sg in cuts], conds, "cache_tail")]
    return SplitGraphs(*pieces, span_inputs=[*first.span_inputs, *conds], span_outputs=first.span_outputs,
                       tail_from_first=[*first.tail_from_first, *conds], hidden_in=first.hidden_in,
                       hidden_out=first.hidden_out, probe=first.probe)


def _interface(sg: SplitGraphs) -> tuple:
    return (sg.span_inputs, sg.span_outputs, sg.tail_from_first, sg.hidden_in, sg.hidden_out, sg.probe,
            *([(v.name, v.type.tensor_type.elem_type) for v in [*m.graph.input, *m.graph.output]]
              for m in (sg.first, sg.rest, sg.tail)))


def _float_span_output(m: onnx.ModelProto, sg: SplitGraphs, prefix: str) -> onnx.ModelProto:
    """`m` with its quantized span output dequantized inside the span (a node named under `prefix`) and quantized
    again, with the same scale and zero point, for what reads it outside."""
    out = sg.span_outputs[0]
    g = m.graph
    prod = next(n for n in g.node if out in n.output)
    if prod.op_type not in _ZP or len(prod.input) <= _ZP[prod.op_type]:
        raise ValueError(f"the cached span ends in {prod.op_type}, whose output scale is not read off it")
    scale, zp = prod.input[_ZP[prod.op_type] - 1], prod.input[_ZP[prod.op_type]]
    inside = {n.name for n in sg.rest.graph.node}
    edited = onnx.ModelProto()
    edited.CopyFrom(m)
    for n in edited.graph.node:
        if n.name not in inside:
            n.input[:] = [LOCAL + "cache_requant" if x == out else x for x in n.input]
    at = next(i for i, n in enumerate(edited.graph.node) if out in n.output) + 1
    edited.graph.node.insert(at, helper.make_node("DequantizeLinear", [out, scale, zp], [LOCAL + "cache_float"],
                                                  name=f"{prefix}cache_float"))
    edited.graph.node.insert(at + 1, helper.make_node("QuantizeLinear", [LOCAL + "cache_float", scale, zp],
                                                      [LOCAL + "cache_requant"], name=LOCAL + "cache_requant"))
    return edited


def _switched(pieces: list[onnx.ModelProto], conds: list[str], name: str, prologue=None) -> onnx.ModelProto:
    """One piece from its K groups' cuts: sibling Ifs, group j's cut running where conds[j] holds (the others pass
    the previous If's outputs on). `prologue` (the first piece): (nodes, initializers) computing conds from the
    graph inputs, the conds then also outputs; else conds are inputs."""
    ref = pieces[0].graph
    keyed = [{t.name: t.SerializeToString() for t in p.graph.initializer} for p in pieces]
    shared = {k for k, v in keyed[0].items() if all(kd.get(k) == v for kd in keyed[1:])}
    inits = [t for t in ref.initializer if t.name in shared]
    outs = [(o.name, o.type.tensor_type.elem_type or TensorProto.FLOAT) for o in ref.output]
    nodes, inputs = [], list(ref.input)
    cond_vi = [helper.make_tensor_value_info(c, TensorProto.BOOL, []) for c in conds]
    if prologue is not None:
        nodes += prologue[0]
        inits += [t for t in prologue[1] if t.name not in {i.name for i in inits}]
    else:
        inputs += cond_vi
    for ty in sorted({ty for _, ty in outs}):  # what the first switch passes on where its group does not run
        inits.append(numpy_helper.from_array(np.zeros((1,), helper.tensor_dtype_to_np_dtype(ty)), f"{name}/none{ty}"))
    prev = [f"{name}/none{ty}" for _, ty in outs]
    for j, (piece, cond) in enumerate(zip(pieces, conds)):
        last = j == len(pieces) - 1
        names = [o for o, _ in outs] if last else [f"{name}/g{j}/{o}" for o, _ in outs]
        passing = helper.make_graph(
            [helper.make_node("Identity", [p], [f"{name}/pass{j}/{k}"]) for k, p in enumerate(prev)], f"{name}_pass{j}",
            [], [helper.make_tensor_value_info(f"{name}/pass{j}/{k}", ty, None) for k, (_, ty) in enumerate(outs)])
        nodes.append(helper.make_node("If", [cond], names, name=f"{name}/if{j}",
                                      then_branch=_branch(piece, j, shared, outs, name), else_branch=passing))
        prev = names
    graph = helper.make_graph(nodes, name, inputs, [*ref.output, *(cond_vi if prologue is not None else [])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=list(pieces[0].opset_import), ir_version=pieces[0].ir_version)


def _branch(piece: onnx.ModelProto, j: int, shared: set[str], outs: list, name: str) -> onnx.GraphProto:
    """Group j's cut as an If branch: what it makes and its own initializers renamed under g{j}| (sibling
    branches name nothing alike), what it reads from outside (the piece's inputs, shared weights) kept."""
    g = piece.graph
    local = {t.name for t in g.initializer if t.name not in shared} | {o for n in g.node for o in n.output if o}

    def rename(x: str) -> str:
        return f"{name}/g{j}|{x}" if x in local else x

    nodes = []
    for n in g.node:
        new = onnx.NodeProto()
        new.CopyFrom(n)
        new.name = f"{name}/g{j}|{n.name}"
        del new.input[:]
        del new.output[:]
        new.input.extend(rename(x) for x in n.input)
        new.output.extend(rename(x) for x in n.output)
        nodes.append(new)
    results = [f"{name}/g{j}|out{k}" for k in range(len(outs))]
    nodes += [helper.make_node("Identity", [rename(o)], [r]) for (o, _), r in zip(outs, results)]
    inits = []
    for t in g.initializer:
        if t.name not in shared:
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = rename(t.name)
            inits.append(c)
    return helper.make_graph(nodes, f"{name}_group{j}", [],
                             [helper.make_tensor_value_info(r, ty, None) for r, (_, ty) in zip(results, outs)],
                             initializer=inits)
