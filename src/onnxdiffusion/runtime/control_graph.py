"""The backbone graph cut to take ControlNet residuals (numpy/onnx only, no torch).

Graph inputs are added, one per down residual and one for the mid residual, and an `Add` on each site the
family names: input 1 of each skip-join node (residual k on the k-th site), and every output of the mid
block that is read outside it. That is UNet2DConditionModel.forward with down_block_additional_residuals /
mid_block_additional_residual; zeros leave the graph's numbers as they were (x + 0 is x). A quantized
backbone is cut the same way: QDQ graphs keep float edges into the joins.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..errors import UserError
from ..families.control import MID, down_name


def residual_names(count: int) -> list[str]:
    return [down_name(k) for k in range(count)] + [MID]


def add_residual_inputs(model: onnx.ModelProto, family, record: dict) -> onnx.ModelProto:
    """In place (and returned): `model` with the residual inputs `record` describes, added where the family says."""
    g = model.graph
    sites, mid_prefix = family.control_sites([n.name for n in g.node])
    residuals = record["residuals"]
    if len(sites) != len(residuals):
        raise UserError(f"the backbone graph has {len(sites)} skip joins, the ControlNet gives {len(residuals)} "
                        "down residuals (a ControlNet of another model size)")
    if any(i.name in (MID, down_name(0)) for i in g.input):
        raise UserError("the backbone graph already takes ControlNet residuals")
    index = {n.name: i for i, n in enumerate(g.node)}
    before: dict[int, list] = {}  # node index -> Add nodes to insert before it
    for k, site in enumerate(sites):
        i = index[site]
        node = g.node[i]
        if len(node.input) < 2:
            raise UserError(f"backbone node {site} has no skip input")
        joined = f"{node.input[1]}__control_{k}"
        before.setdefault(i, []).append(helper.make_node("Add", [node.input[1], down_name(k)], [joined],
                                                         name=f"/control/down_{k}/Add"))
        node.input[1] = joined
    mid_out = _mid_outputs(g, mid_prefix)
    if len(mid_out) != 1:
        raise UserError(f"the backbone's mid block gives {len(mid_out)} tensors read after it, expected one")
    (tensor, producer), = mid_out.items()
    joined = f"{tensor}__control_mid"
    after_mid = helper.make_node("Add", [tensor, MID], [joined], name="/control/mid/Add")
    for n in g.node:
        if not n.name.startswith(mid_prefix):
            for j, x in enumerate(n.input):
                if x == tensor:
                    n.input[j] = joined
    nodes = []
    for i, n in enumerate(g.node):
        nodes.extend(before.get(i, []))
        nodes.append(n)
        if i == producer:
            nodes.append(after_mid)
    del g.node[:]
    g.node.extend(nodes)
    for k, (c, f) in enumerate(residuals):
        g.input.append(_input(down_name(k), c, f))
    g.input.append(_input(MID, *record["mid"]))
    return model


def _input(name: str, channels: int, f: int):
    h, w = ("height_latent", "width_latent") if f == 1 else (f"height_latent_{f}", f"width_latent_{f}")
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", int(channels), h, w])


def _mid_outputs(g, prefix: str) -> dict[str, int]:
    """Tensors made inside `prefix` and read outside it -> the index of the node making each."""
    made = {o: i for i, n in enumerate(g.node) if n.name.startswith(prefix) for o in n.output if o}
    outside = {x for n in g.node if not n.name.startswith(prefix) for x in n.input}
    return {t: i for t, i in made.items() if t in outside}
