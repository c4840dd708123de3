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
    sites, (mid_node, mid_input) = family.control_sites([n.name for n in g.node])
    residuals = record["residuals"]
    if len(sites) != len(residuals):
        raise UserError(f"the backbone graph has {len(sites)} skip joins, the ControlNet gives {len(residuals)} "
                        "down residuals (a ControlNet of another model size)")
    if any(i.name in (MID, down_name(0)) for i in g.input):
        raise UserError("the backbone graph already takes ControlNet residuals")
    _float_joins(g, set(sites))
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
    index = {n.name: i for i, n in enumerate(g.node)}
    tensor = g.node[index[mid_node]].input[mid_input]
    producer = next((i for i, n in enumerate(g.node) if tensor in n.output), None)
    if producer is None:
        raise UserError(f"the backbone's mid-block edge {tensor!r} has no producer node")
    joined = f"{tensor}__control_mid"
    after_mid = helper.make_node("Add", [tensor, MID], [joined], name="/control/mid/Add")
    for i, n in enumerate(g.node):
        if i != producer:  # the block's output: every reader is after it
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


def _float_joins(g, sites: set[str]) -> None:
    """An int8 graph saved after ONNX Runtime's optimizer may join a skip edge in a QLinearConcat (uint8 in and
    out): it is turned back into what it fused, DequantizeLinear per input -> Concat -> QuantizeLinear, so
    the residual is added in float before the join's own requantization (the QDQ graph's numbers)."""
    nodes = []
    for n in g.node:
        if n.name not in sites or n.op_type != "QLinearConcat":
            nodes.append(n)
            continue
        axis = next(a.i for a in n.attribute if a.name == "axis")
        ys, yz, *tuples = n.input
        floats = []
        for k in range(0, len(tuples), 3):
            x, xs, xz = tuples[k:k + 3]
            floats.append(f"{n.name}/in_{k // 3}_float")
            nodes.append(helper.make_node("DequantizeLinear", [x, xs, xz], [floats[-1]], name=f"{n.name}/DQ_{k // 3}"))
        joined = f"{n.name}/float_out"
        nodes.append(helper.make_node("Concat", floats, [joined], name=n.name, axis=axis))
        nodes.append(helper.make_node("QuantizeLinear", [joined, ys, yz], list(n.output), name=f"{n.name}/Q"))
    del g.node[:]
    g.node.extend(nodes)
