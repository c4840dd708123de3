"""Joint attention's query rows that nothing reads, dropped from the graph.

An MMDiT block attends over image and text tokens at once: ``MultiHeadAttention(Concat(q_img, q_txt), K, V)``,
then slices the output back into the two streams.  Where only one stream's slice is read (SD3's last block has
no text output; a step-cached first piece reads only the image stream), the other stream's query rows are
computed and thrown away; with 280 text tokens against 64 image tokens that is most of the attention.  Attention
rows are independent of each other, so giving the attention only the read stream's queries computes the same
rows.  The rewrite is made only where the graph shows it is exact: the output is read only through Slices on
the token axis, all selecting the same part, whose bounds are that part's own token count (``Shape(T)[1]`` of a
tensor T the part's queries are computed from row by row) or open ends.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..onnxio.graph_order import live_nodes, remove_dead_nodes

# ops whose output has the token rows of the input followed (the other inputs are weights / per-channel constants)
_ROW_OPS = {"MatMul", "MatMulIntegerToFloat", "MatMulInteger", "Add", "Mul", "Sub", "Div", "QuantizeLinear",
            "DequantizeLinear", "LayerNormalization", "SimplifiedLayerNormalization", "Cast", "Identity"}
_OPEN = 2**30  # a Slice end at least this large reads to the end of the axis


def without_dead_queries(model: onnx.ModelProto) -> bool:
    """In place: prune_dead_queries, then the nodes nothing reads any more dropped (ONNX Runtime would run
    them: it runs every node of a session). The graph's inputs and outputs stay as they are."""
    if not prune_dead_queries(model):
        return False
    remove_dead_nodes(model)
    return True


def prune_dead_queries(model: onnx.ModelProto) -> int:
    """In place: every attention whose output is read only through one stream's slice gets that stream's queries
    alone (the slices become Identity). Returns how many attentions were rewritten; the dropped stream's query
    nodes are left dead (without_dead_queries drops them)."""
    g = model.graph
    consts = {t.name: t for t in g.initializer}
    consts.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"})
    prod = {o: n for n in g.node for o in n.output if o}
    graph_outputs = {o.name for o in g.output}
    users: dict[str, list] = {}  # a dead reader (a slice nothing reads) does not count
    for n in live_nodes(g):
        for t in n.input:
            users.setdefault(t, []).append(n)
    static = set(consts)  # computed from constants alone (e.g. a float16-stored weight's Cast)
    for n in g.node:
        if n.input and all(t in static for t in n.input if t):
            static.update(o for o in n.output if o)
    done = 0
    for n in list(g.node):
        if n.op_type != "MultiHeadAttention" or n.domain != "com.microsoft" or len(n.input) < 3:
            continue
        cat = prod.get(n.input[0])
        if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or _attr(cat, "axis") not in (1, -2):
            continue
        if any(o and (users.get(o) or o in graph_outputs) for o in n.output[1:]) or n.output[0] in graph_outputs:
            continue
        readers = _slices(n.output[0], users, consts, graph_outputs)
        parts = {_part_read(s, cat.input[0], consts, prod, static) for s in readers}
        if not readers or len(parts) != 1 or None in parts:
            continue
        n.input[0] = cat.input[parts.pop()]
        for s in readers:
            del s.input[1:]
            s.op_type = "Identity"
        done += 1
    return done


def _slices(tensor: str, users, consts, graph_outputs) -> list:
    """The nodes reading `tensor`, through per-tensor (De)QuantizeLinear, if all are Slices; else []."""
    found = []
    for u in users.get(tensor, []):
        scalar = all((c := _const(t, consts)) is not None and c.size == 1 for t in u.input[1:] if t)
        if u.op_type in ("QuantizeLinear", "DequantizeLinear") and scalar and u.output[0] not in graph_outputs:
            more = _slices(u.output[0], users, consts, graph_outputs)
            if not more:
                return []
            found += more
        elif u.op_type == "Slice" and u.input[0] == tensor:
            found.append(u)
        else:
            return []
    return found


def _part_read(node, first_part: str, consts, prod, static) -> int | None:
    """0 / 1: the Concat part this Slice reads exactly (data, starts, ends, axes = [1], steps = [1]); else None."""
    if node.op_type != "Slice" or len(node.input) < 4:
        return None
    axes = _const(node.input[3], consts)
    steps = _const(node.input[4], consts) if len(node.input) > 4 and node.input[4] else np.array([1])
    if axes is None or steps is None or axes.tolist() not in ([1], [-2]) or steps.tolist() != [1]:
        return None
    start, end = node.input[1], node.input[2]
    first_len = _seq_source(end, consts, prod)
    s0 = _const(start, consts)
    if s0 is not None and s0.tolist() == [0] and first_len and _rows_from(first_part, first_len, prod, static):
        return 0
    starts_at = _seq_source(start, consts, prod)
    e = _const(end, consts)
    if e is not None and e.size == 1 and int(e.reshape(-1)[0]) >= _OPEN and starts_at \
            and _rows_from(first_part, starts_at, prod, static):
        return 1
    return None


def _seq_source(tensor: str, consts, prod) -> str | None:
    """T where `tensor` is [T.shape[1]] (Unsqueeze(Gather(Shape(T), 1)) or Shape(T, start=1, end=2))."""
    n = prod.get(tensor)
    if n is not None and n.op_type == "Unsqueeze":
        axes = _const(n.input[1], consts) if len(n.input) > 1 else np.array(_attr(n, "axes") or [])
        g = prod.get(n.input[0])
        if axes is None or axes.tolist() != [0] or g is None or g.op_type != "Gather" or (_attr(g, "axis") or 0) != 0:
            return None
        idx = _const(g.input[1], consts)
        shape = prod.get(g.input[0])
        if idx is None or idx.size != 1 or int(idx.reshape(-1)[0]) != 1 or shape is None or shape.op_type != "Shape":
            return None
        return shape.input[0] if (_attr(shape, "start") or 0) == 0 else None
    if n is not None and n.op_type == "Shape" and _attr(n, "start") == 1 and _attr(n, "end") == 2:
        return n.input[0]
    return None


def _rows_from(tensor: str, source: str, prod, static, depth: int = 12) -> bool:
    """`tensor` is computed from `source` row by row (so has its token count)."""
    for _ in range(depth):
        if tensor == source:
            return True
        n = prod.get(tensor)
        if n is None or n.op_type not in _ROW_OPS:
            return False
        data = [t for t in n.input[:2] if t and t not in static]
        if n.op_type in ("MatMul", "MatMulIntegerToFloat", "MatMulInteger", "QuantizeLinear", "DequantizeLinear",
                         "LayerNormalization", "SimplifiedLayerNormalization", "Cast", "Identity"):
            data = [n.input[0]] if n.input[0] not in static else []
        if len(data) != 1:
            return False
        tensor = data[0]
    return False


def _const(name: str, consts) -> np.ndarray | None:
    t = consts.get(name)
    return None if t is None else numpy_helper.to_array(t)


def _attr(node, name):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None
