"""Backbone graphs made inlinable: every tensor renamed under a prefix, weights kept as initializers,
and the nodes copied into a sampling graph with their inputs bound to a step's tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

CONTEXT = "encoder_hidden_states"
BACKBONE_IO = {"sample": "sample", "timestep": "timestep", "cond:" + CONTEXT: CONTEXT, "out": "out_sample"}


@dataclass(frozen=True)
class Backbone:
    """A backbone graph split into what goes outer scope (weights) and what goes in the body."""

    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    io: dict[str, str]
    opset_imports: list[onnx.OperatorSetIdProto]
    functions: list[onnx.FunctionProto]
    weight_names: frozenset[str]


def load_component(model: onnx.ModelProto, io: dict[str, str], prefix: str) -> Backbone:
    """Rename every tensor of a component graph under `prefix` so it can be inlined beside others.

    `io` maps roles to the component's graph input/output names ("out" is the output). Weights
    referenced by name stay initializers; nothing is copied.
    """
    g = model.graph
    graph_inputs = {i.name for i in g.input}
    missing = [v for k, v in io.items() if not k.startswith("out") and v not in graph_inputs]
    if missing or io["out"] not in {o.name for o in g.output}:
        raise ValueError(f"{prefix.rstrip('/')} graph lacks inputs/outputs {missing or [io['out']]}")

    def rename(name: str) -> str:
        return name if name == "" else prefix + name

    nodes = []
    for node in g.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        del new.output[:]
        new.input.extend(rename(x) for x in node.input)
        new.output.extend(rename(x) for x in node.output)
        new.name = rename(node.name or f"node{len(nodes)}")
        rename_outer_refs(new, rename)
        nodes.append(new)
    inits = []
    for t in g.initializer:
        new_t = onnx.TensorProto()
        new_t.CopyFrom(t)
        new_t.name = rename(t.name)
        inits.append(new_t)
    return Backbone(
        nodes=nodes,
        initializers=inits,
        io={k: rename(v) for k, v in io.items()},
        opset_imports=list(model.opset_import),
        functions=list(model.functions),
        weight_names=frozenset(t.name for t in inits),
    )


def conditioning_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The backbone's inputs other than sample and timestep (the family's conditioning), in order; inputs
    with a default (an initializer, e.g. LoRA insertion points) are not conditioning."""
    defaults = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input
            if i.name not in (BACKBONE_IO["sample"], BACKBONE_IO["timestep"]) and i.name not in defaults]


def latent_dims(model: onnx.ModelProto, latent_channels: int) -> list:
    """The sampler state's dims after the batch: NCHW keeps the names it always had; other
    layouts (packed tokens) take the backbone sample's own."""
    sample = next(i for i in model.graph.input if i.name == BACKBONE_IO["sample"])
    dims = sample.type.tensor_type.shape.dim
    if len(dims) == 4:
        return [latent_channels, "height", "width"]
    # packed tokens: the output's token width is the state's (an inpainting backbone's sample is wider)
    out = next(o for o in model.graph.output if o.name == BACKBONE_IO["out"]).type.tensor_type.shape.dim
    dims = [*list(dims)[:-1], out[-1]] if len(out) == len(dims) and out[-1].dim_value else dims
    return [d.dim_value if d.dim_value else (d.dim_param or f"latent_{k}") for k, d in enumerate(dims)][1:]


def sample_channels(backbone: onnx.ModelProto) -> int:
    """Channels of a backbone's sample input: NCHW's axis 1, packed tokens' last (0 when not fixed)."""
    sample = next(i for i in backbone.graph.input if i.name == BACKBONE_IO["sample"])
    dims = sample.type.tensor_type.shape.dim
    axis = 1 if len(dims) == 4 else len(dims) - 1
    return int(dims[axis].dim_value) if dims[axis].dim_value else 0


def load_backbone(model: onnx.ModelProto, prefix: str = "unet/") -> Backbone:
    io = {"sample": BACKBONE_IO["sample"], "timestep": BACKBONE_IO["timestep"], "out": BACKBONE_IO["out"]}
    io.update({f"cond:{i.name}": i.name for i in conditioning_inputs(model)})
    return load_component(model, io, prefix)


def rename_outer_refs(node: onnx.NodeProto, rename: Callable[[str], str]) -> None:
    """If/Loop inside the backbone: their bodies read outer names, which were renamed."""
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in graphs:
            local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            for n in sub.node:
                local.update(n.output)
            for n in sub.node:
                for k, x in enumerate(n.input):
                    if x and x not in local:
                        n.input[k] = rename(x)
                rename_outer_refs(n, rename)
            for o in sub.output:
                if o.name not in local:
                    o.name = rename(o.name)


def inline_backbone(nodes: list[onnx.NodeProto], bb: Backbone, remap: dict[str, str], tag: str) -> str:
    """Append the backbone's nodes to `nodes`, its inputs bound by `remap`; returns its output's name.

    `tag` "" (a Loop body: one copy) keeps the node names; otherwise (unrolled: one copy per step)
    every intermediate name gets the tag, weights excepted."""

    def rename(x_: str) -> str:
        if x_ in remap:
            return remap[x_]
        return x_ if not tag or not x_ or x_ in bb.weight_names else tag + x_

    for node in bb.nodes:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        if tag:
            del new.input[:]
            del new.output[:]
            new.input.extend(rename(x_) for x_ in node.input)
            new.output.extend(tag + o for o in node.output)
            new.name = tag + node.name
        else:
            for k_, x_ in enumerate(new.input):
                if x_ in remap:
                    new.input[k_] = remap[x_]
        # If/Loop nodes inside the backbone (timestep-group switches) read outer names too
        rename_outer_refs(new, rename)
        nodes.append(new)
    return tag + bb.io["out"] if tag else bb.io["out"]
