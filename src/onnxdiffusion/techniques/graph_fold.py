"""cache_math.fold_sum's Loop-graph twin (step caching's first_block and adaptive stopping both fold)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

I64, BOOL, F = TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT


def fold_constants(b) -> None:
    """The constants fold_sum reads, added once."""
    have = {t.name for t in b.inits}
    for name, value in (("cache_one_i64", np.array(1, np.int64)), ("cache_two_i64", np.array(2, np.int64)),
                        ("cache_flat", np.array([-1], np.int64)), ("cache_scalar", np.zeros((0,), np.int64)),
                        ("cache_head", np.array([0], np.int64))):
        if name not in have:
            b.const(name, value)


def fold_sum(b, x: str, tag: str) -> str:
    """A Loop halving the flattened tensor (one zero appended to an odd length) until one value is left."""
    flat = b.op("Reshape", [x, "cache_flat"], f"{tag}_flat")
    go = b.op("Greater", [b.op("Size", [flat], f"{tag}_size"), "cache_one_i64"], f"{tag}_go")
    body = type(b)()
    v = f"{tag}_v"
    n = body.op("Size", [v], f"{tag}_n")
    half = body.op("Div", [body.op("Add", [n, "cache_one_i64"], f"{tag}_n1"), "cache_two_i64"], f"{tag}_half")
    even = body.op("Mul", [half, "cache_two_i64"], f"{tag}_even")
    pad = body.op("Unsqueeze", [body.op("Sub", [even, n], f"{tag}_pad"), "axes0"], f"{tag}_pad1")
    padded = body.op("Pad", [v, body.op("Concat", ["cache_head", pad], f"{tag}_pads", axis=0)], f"{tag}_padded")
    mid = body.op("Unsqueeze", [half, "axes0"], f"{tag}_mid")
    end = body.op("Unsqueeze", [even, "axes0"], f"{tag}_end")
    lo = body.op("Slice", [padded, "cache_head", mid], f"{tag}_lo")
    hi = body.op("Slice", [padded, mid, end], f"{tag}_hi")
    body.op("Add", [lo, hi], f"{tag}_v_next")
    body.op("Greater", [half, "cache_one_i64"], f"{tag}_more")
    graph = helper.make_graph(
        body.nodes, f"{tag}_body",
        [helper.make_tensor_value_info(f"{tag}_it", I64, []), helper.make_tensor_value_info(f"{tag}_cond", BOOL, []),
         helper.make_tensor_value_info(v, F, None)],
        [helper.make_tensor_value_info(f"{tag}_more", BOOL, []), helper.make_tensor_value_info(f"{tag}_v_next", F, None)])
    b.nodes.append(helper.make_node("Loop", ["", go, flat], [f"{tag}_folded"], name=f"{tag}_loop", body=graph))
    return b.op("Reshape", [f"{tag}_folded", "cache_scalar"], f"{tag}_sum")
