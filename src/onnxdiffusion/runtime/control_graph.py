"""The backbone graph cut to take ControlNet residuals (numpy/onnx only, no torch).

Graph inputs are added, one per residual the family names (`control_residuals`), and an `Add` on each
edge it names (`control_joins`): for a UNet input 1 of each skip-join node and every reader of the mid
block's output (UNet2DConditionModel.forward with down_block_additional_residuals /
mid_block_additional_residual); for an MMDiT the hidden_states each block hands to the next
(block_controlnet_hidden_states). Zeros leave the graph's numbers as they were (x + 0 is x). A quantized
backbone is cut the same way: QDQ graphs keep float edges into the joins.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..errors import UserError


def residual_names(family, record: dict) -> list[str]:
    return [name for name, _ in family.control_residuals(record)]


def add_residual_inputs(model: onnx.ModelProto, family, record: dict) -> onnx.ModelProto:
    """In place (and returned): `model` with the residual inputs `record` describes, added where the family says."""
    g = model.graph
    try:
        inputs = family.control_residuals(record)
    except (KeyError, TypeError, ValueError):
        raise UserError("the ControlNet's manifest record does not describe its residuals") from None
    names = {n for n, _ in inputs}
    if any(i.name in names for i in g.input):
        raise UserError("the backbone graph already takes ControlNet residuals")
    joins = family.control_joins(list(g.node), record)
    _float_joins(g, {node for _, node, _, every in joins if not every})
    index = {n.name: i for i, n in enumerate(g.node)}
    before: dict[int, list] = {}  # node index -> Add nodes to insert before it
    after: dict[int, list] = {}  # producer index -> Add nodes to insert after it
    for k, (residual, site, slot, every) in enumerate(joins):
        if residual not in names or site not in index:
            raise UserError(f"the family's ControlNet join {site!r} / {residual!r} is not in the backbone graph")
        node = g.node[index[site]]
        if len(node.input) <= slot:
            raise UserError(f"backbone node {site} has no input {slot}")
        tensor = node.input[slot]
        joined = f"{tensor}__control_{k}"
        add = helper.make_node("Add", [tensor, residual], [joined], name=f"/control/join_{k}/Add")
        if not every:
            before.setdefault(index[site], []).append(add)
            node.input[slot] = joined
            continue
        producer = next((i for i, n in enumerate(g.node) if tensor in n.output), None)
        if producer is None:
            raise UserError(f"the backbone's edge {tensor!r} (ControlNet join) has no producer node")
        for i, n in enumerate(g.node):
            if i != producer:  # a block's output: every reader is after it
                for j, x in enumerate(n.input):
                    if x == tensor:
                        n.input[j] = joined
        after.setdefault(producer, []).append(add)
    nodes = []
    for i, n in enumerate(g.node):
        nodes.extend(before.get(i, []))
        nodes.append(n)
        nodes.extend(after.get(i, []))
    del g.node[:]
    g.node.extend(nodes)
    for name, dims in inputs:
        g.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [d if isinstance(d, str) else int(d)
                                                                               for d in dims]))
    return model


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
