"""Group Hadamard rotation of the linears' inputs (ConvRot-style), as a graph rewrite and its numpy twin.

    model, report = rotate_linears(model, names, group=64)

A rotation R with R R^T = I leaves x W unchanged as (x R)(R^T W). R here is block-diagonal: one
normalized *regular* Hadamard matrix H (order 4^k, every row sums to the same value; symmetric, so
H^T = H = H^-1) per group of `group` input channels. Per-channel outliers of x are spread over their
group, so the per-tensor int8 activation range (and the per-block 4-bit weight scales) no longer
fit a few large channels. The weight side is folded offline (R^T W); the activation side costs one
block-diagonal MatMul per rotated tensor (Reshape to (-1, g), MatMul by H, Reshape back: g MACs per
element), shared by every rotated linear reading the tensor, or nothing at all when the tensor's
producer is a constant-weight MatMul (+ constant bias) read only by rotated linears: then its
weight and bias columns are rotated instead (exact, no op added).

The Hadamard matrices are Constant nodes, not initializers: the quantizers list only linears whose
weight is an initializer, so the rotation MatMuls stay float (and are never calibrated as linears).
Pure `onnx` + numpy; nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import files
from .configs_base import ROTATION_GROUPS as GROUPS, parse_rotate  # noqa: F401 - parse_rotate re-exported
from ..onnxio.graph_order import outer_reads, subgraphs
from .graphs import initializer_map, remove_dead_nodes

ROTATED_SUFFIX = "/hadamard"


def hadamard(order: int) -> np.ndarray:
    """The normalized regular Hadamard matrix of `order` (a power of 4), float64, symmetric and orthogonal.

    Order 4 is J - 2I (rows sum to 2); Kronecker products of regular ones stay regular. Regular rows
    have equal sums, so a channel-wise offset (a per-channel mean) is spread evenly too (ConvRot)."""
    if order < 4 or 4 ** round(np.log(order) / np.log(4)) != order:
        raise ValueError(f"no regular Hadamard matrix of order {order} here")
    h4 = np.ones((4, 4)) - 2 * np.eye(4)
    h = np.ones((1, 1))
    while h.shape[0] < order:
        h = np.kron(h, h4)
    return h / np.sqrt(order)


def group_for(channels: int, group: int) -> int:
    """The largest rotation order <= `group` that divides `channels` (0: none; the smallest is 16: fewer
    channels per group spread an outlier too little to pay for the MatMul)."""
    for g in sorted(GROUPS, reverse=True):
        if g <= group and channels % g == 0:
            return g
    return 0


# --- the numpy twin --------------------------------------------------------------------------

def rotate_activation(x: np.ndarray, group: int) -> np.ndarray:
    """x R: each group of `group` channels of the last axis times H (what the graph's rotation computes)."""
    h = hadamard(group).astype(x.dtype)
    return (x.reshape(-1, group) @ h).reshape(x.shape)


def rotate_weight(w: np.ndarray, group: int) -> np.ndarray:
    """R^T W for a (K, N) weight read as x W: each group of `group` rows mixed by H (float64 inside)."""
    k, n = w.shape
    h = hadamard(group)
    out = np.einsum("ij,bjn->bin", h, w.astype(np.float64).reshape(k // group, group, n))
    return out.reshape(k, n).astype(w.dtype)


def rotate_columns(w: np.ndarray, group: int) -> np.ndarray:
    """W R: each group of `group` columns (the last axis) mixed by H, for a producer whose output is rotated."""
    return rotate_activation(w.astype(np.float64), group).astype(w.dtype)


def rotated_linear(x: np.ndarray, w: np.ndarray, group: int, bias: np.ndarray | None = None) -> np.ndarray:
    """The eager twin of a rotated linear: (x R)(R^T W) + b == x W + b."""
    y = rotate_activation(x, group) @ rotate_weight(w, group)
    return y if bias is None else y + bias


# --- the graph rewrite -----------------------------------------------------------------------

def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _weight_kn(model, inits, n) -> tuple[np.ndarray, bool] | None:
    """The (K, N) weight of a rotatable linear and whether it is stored transposed (Gemm transB)."""
    if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in inits:
        return None
    t = inits[n.input[1]]
    if len(t.dims) != 2 or t.data_type != onnx.TensorProto.FLOAT:
        return None
    a = _attrs(n)
    if n.op_type == "Gemm" and (a.get("transA", 0) or float(a.get("alpha", 1.0)) != 1.0):
        return None
    w = files.array(model, t)
    trans = bool(a.get("transB", 0)) if n.op_type == "Gemm" else False
    return (w.T if trans else w), trans


def rotatable(model: onnx.ModelProto, names: Iterable[str], group: int) -> dict[str, tuple[int, list[str]]]:
    """Activation tensor -> (rotation order, the named linears reading it with a constant 2-D weight)."""
    inits = initializer_map(model)
    wanted = set(names)
    out: dict[str, tuple[int, list[str]]] = {}
    for n in model.graph.node:
        if n.name not in wanted or n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in inits:
            continue
        t = inits[n.input[1]]
        if len(t.dims) != 2 or t.data_type != onnx.TensorProto.FLOAT:
            continue
        a = _attrs(n)
        if n.op_type == "Gemm" and (a.get("transA", 0) or float(a.get("alpha", 1.0)) != 1.0):
            continue
        k = t.dims[0] if not a.get("transB", 0) or n.op_type == "MatMul" else t.dims[1]
        g = group_for(int(k), group)
        if g:
            out.setdefault(n.input[0], (g, []))[1].append(n.name)
    return out


def _foldable_producer(x, g, readers, producer, inits, graph_outputs, rotated) -> list[onnx.NodeProto] | None:
    """[MatMul] or [MatMul, Add] producing x from constants alone, whose outputs only rotated linears read."""
    if x in graph_outputs or any(r.name not in rotated for r in readers.get(x, [])):
        return None
    p = producer.get(x)
    chain = []
    if p is not None and p.op_type == "Add":
        consts = [i for i in p.input if i in inits]
        if len(consts) != 1 or len(inits[consts[0]].dims) != 1 or inits[consts[0]].dims[0] % g:
            return None
        mm_out = p.input[0] if p.input[1] == consts[0] else p.input[1]
        if len(readers.get(mm_out, [])) != 1 or mm_out in graph_outputs:
            return None
        chain.append(p)
        p = producer.get(mm_out)
    if p is None or p.op_type != "MatMul" or p.input[1] not in inits or len(inits[p.input[1]].dims) != 2:
        return None
    return [p, *chain]


def rotate_linears(model: onnx.ModelProto, names: Iterable[str], group: int) -> tuple[onnx.ModelProto, dict]:
    """A copy where every named constant-weight MatMul / Gemm whose input width has a rotation order
    (group_for) reads its input rotated and holds R^T W. Returns (copy, counts for the report).

    `model` is only read. The copy never holds the weights being replaced: they are rotated one at a
    time from `model` (or its external data) into the copy, so a 2 GB backbone costs one more backbone
    plus one weight, not three (issue 44: the full-width W8A8 ran out of memory)."""
    src = model.graph
    inits = initializer_map(model)
    sites = rotatable(model, names, group)
    rotated = {m for _, ms in sites.values() for m in ms}
    producer = {o: n for n in src.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in src.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    by_src = {n.name: n for n in src.node}
    graph_outputs = {o.name for o in src.output}
    plan: dict[str, list[tuple[str, int]]] = {}  # node -> the steps from its original (K, N) weight, in order
    transposed: dict[str, bool] = {}
    biases: dict[str, np.ndarray] = {}  # Add node -> its rotated constant
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    repoint: list[tuple[str, str]] = []  # (linear, the rotated tensor it reads)
    counts = {"group": group, "tensors": len(sites), "linears": len(rotated), "folded_into_producer": 0,
              "rotation_matmuls": 0, "rotation_orders": {}}
    hnames: dict[int, str] = {}
    for x, (g, mms) in sites.items():
        for m in mms:  # R^T W of the original weight, even where an earlier step rotated it (as always)
            plan[m], transposed[m] = [("rows", g)], _stored_transposed(by_src[m])
        chain = _foldable_producer(x, g, readers, producer, inits, graph_outputs, rotated)
        if chain is not None:  # x R computed by the producer itself: W0 R (and b R)
            p = chain[0]
            plan.setdefault(p.name, []).append(("cols", g))
            transposed.setdefault(p.name, False)
            if len(chain) == 2:
                add = chain[1]
                c = next(i for i in add.input if i in inits)
                biases[add.name] = rotate_columns(files.array(model, inits[c])[None, :], g)[0]
            counts["folded_into_producer"] += 1
            continue
        hname = hnames.setdefault(g, f"hadamard_{g}")
        flat, mixed, shape = f"{x}/rot_flat", f"{x}/rot_mixed", f"{x}/rot_shape"
        xr = f"{x}/rotated"
        first = mms[0]
        new_nodes[x] = [
            helper.make_node("Shape", [x], [shape], name=f"{first}{ROTATED_SUFFIX}/shape"),
            helper.make_node("Reshape", [x, f"{hname}/rows"], [flat], name=f"{first}{ROTATED_SUFFIX}/flat"),
            helper.make_node("MatMul", [flat, hname], [mixed], name=f"{first}{ROTATED_SUFFIX}"),
            helper.make_node("Reshape", [mixed, shape], [xr], name=f"{first}{ROTATED_SUFFIX}/back"),
        ]
        repoint.extend((m, xr) for m in mms)
        counts["rotation_matmuls"] += 1
        counts["rotation_orders"][str(g)] = counts["rotation_orders"].get(str(g), 0) + 1
    out = _copy_without(model, _replaced_weights(model, by_src, plan))
    g_ = out.graph
    by_name = {n.name: n for n in g_.node}
    for m, xr in repoint:
        by_name[m].input[0] = xr
    _store_weights(out, model, inits, by_name, plan, transposed, biases)
    consts = []
    for conv, const, rot in _rotate_patchify(out, names, group):
        consts.append(const)
        new_nodes.setdefault(conv.input[0], []).append(rot)
        conv.input[0] = rot.output[0]
        counts["patchify_convs"] = counts.get("patchify_convs", 0) + 1
    for g, hname in sorted(hnames.items()):
        consts.append(helper.make_node("Constant", [], [hname], name=f"{hname}/const",
                                       value=numpy_helper.from_array(hadamard(g).astype(np.float32), hname)))
        consts.append(helper.make_node("Constant", [], [f"{hname}/rows"], name=f"{hname}/rows_const",
                                       value=numpy_helper.from_array(np.array([-1, g], np.int64), f"{hname}/rows")))
    nodes = consts + [n for i in g_.input if i.name in new_nodes for n in new_nodes[i.name]]
    for n in g_.node:  # each rotation right after its input's producer keeps the graph sorted
        nodes.append(n)
        for o in n.output:
            nodes.extend(new_nodes.get(o, []))
    del g_.node[:]
    g_.node.extend(nodes)
    remove_dead_nodes(out)
    return out, counts


def _stored_transposed(n: onnx.NodeProto) -> bool:
    return n.op_type == "Gemm" and bool(_attrs(n).get("transB", 0))


def _replaced_weights(model: onnx.ModelProto, by_src: dict, plan: dict) -> set[str]:
    """The weights of `plan` that nothing else reads (not another node, input, graph output or subgraph):
    dead once rotated, so the copy need not hold them."""
    g = model.graph
    candidates = {by_src[m].input[1] for m in plan}
    ours = {(m, 1) for m in plan}
    keep = {o.name for o in g.output}
    for n in g.node:
        keep.update(x for i, x in enumerate(n.input) if x in candidates and (n.name, i) not in ours)
        for sub in subgraphs(n):
            keep.update(outer_reads(sub))
    return candidates - keep


def _copy_without(model: onnx.ModelProto, skip: set[str]) -> onnx.ModelProto:
    """A copy of `model` less the initializers named in `skip` (never copied: that is the memory saved)."""
    out = onnx.ModelProto()
    _copy_fields(model, out, ("graph",))
    _copy_fields(model.graph, out.graph, ("initializer",))
    out.graph.initializer.extend(t for t in model.graph.initializer if t.name not in skip)
    return out


def _copy_fields(src, dst, but: tuple[str, ...]) -> None:
    for fd, value in src.ListFields():
        if fd.name in but:
            continue
        if hasattr(value, "extend"):  # a repeated field (the descriptor's `label` is gone in newer protobuf)
            getattr(dst, fd.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _rotate_patchify(model: onnx.ModelProto, names: Iterable[str], group: int) -> list[tuple[onnx.NodeProto, ...]]:
    """In place: every named patchify Conv (kernel == stride > 1, no padding, dilation or groups: a linear over
    each patch's K = C*kh*kw values) becomes a float rotation Conv (its K x K weight R, a Constant) followed
    by the original as a 1x1 Conv holding W R. Only where the dense rotation costs <= a quarter of the
    conv (K <= O / 4). Returns (the rewritten conv, the Constant R, the rotation conv to insert before it) each."""
    inits = initializer_map(model)
    wanted = set(names)
    out = []
    for n in model.graph.node:
        if n.op_type != "Conv" or n.name not in wanted or len(n.input) < 2 or n.input[1] not in inits:
            continue
        t = inits[n.input[1]]
        a = _attrs(n)
        if len(t.dims) != 4 or t.data_type != onnx.TensorProto.FLOAT:
            continue
        o, c, kh, kw = (int(d) for d in t.dims)
        k = c * kh * kw
        plain = (list(a.get("strides", [1, 1])) == [kh, kw] and kh * kw > 1 and not any(a.get("pads", [0])) and
                 a.get("group", 1) == 1 and set(a.get("dilations", [1])) == {1} and a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET"))
        g = group_for(k, group)
        if not plain or not g or k > o // 4:
            continue
        r = np.kron(np.eye(k // g), hadamard(g))  # block-diagonal, symmetric: R^T = R
        w = files.array(model, t).astype(np.float64).reshape(o, k) @ r
        wt = numpy_helper.from_array(w.reshape(o, k, 1, 1).astype(np.float32), f"{n.name}/rotated_weight")
        model.graph.initializer.append(wt)
        hc = numpy_helper.from_array(r.reshape(k, c, kh, kw).astype(np.float32), f"{n.name}{ROTATED_SUFFIX}/weight")
        const = helper.make_node("Constant", [], [hc.name], name=f"{hc.name}/const", value=hc)
        rot = helper.make_node("Conv", [n.input[0], hc.name], [f"{n.input[0]}/patches_rotated"], name=f"{n.name}{ROTATED_SUFFIX}",
                               kernel_shape=[kh, kw], strides=[kh, kw])
        n.input[1] = wt.name
        del n.attribute[:]
        n.attribute.extend([helper.make_attribute("kernel_shape", [1, 1]), helper.make_attribute("strides", [1, 1])])
        out.append((n, const, rot))
    return out


def _store_weights(out, model, inits, by_name, plan, transposed, biases) -> None:
    """Each planned weight, one at a time: the original from `model` through its steps into `out`."""
    g = out.graph
    for name, steps in plan.items():
        node = by_name[name]
        w = files.array(model, inits[node.input[1]])
        w = w.T if transposed[name] else w
        for kind, order in steps:
            w = rotate_weight(w, order) if kind == "rows" else rotate_columns(w, order)
        stored = w.T if transposed[name] else w
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(stored, np.float32), f"{name}/rotated_weight"))
        node.input[1] = g.initializer[-1].name
        del w, stored
    out_inits = initializer_map(out)
    for name, b in biases.items():
        node = by_name[name]
        i = next(k for k, x in enumerate(node.input) if x in out_inits)
        t = numpy_helper.from_array(np.ascontiguousarray(b, np.float32), f"{name}/rotated_bias")
        g.initializer.append(t)
        node.input[i] = t.name
