"""Step caching in the Loop graph: runtime/cache.py's policies as loop-carried state and an ``If``.

The backbone comes cut in three (runtime/backbone_split.py: first -> rest -> tail); each step runs
`first`, decides, and an ``If`` runs `rest` (the span a cached step skips) or stands in for it with
the carried tensors, then `tail`. The decision and the stand-in use cache_math's arithmetic, the host
loop's, op for op:

  deepcache    full when step % cache_interval == 0; the span's last output carried
  taylorseer   full for the warm-up steps, then every cache_interval steps; finite differences
               over full steps carried (one tensor per order, a count, the last full step)
  first_block  full when sum|r - prev| / sum|prev| > cache_threshold (r: the first block's residual,
               fold_sum's order); the previous residual and the span's residual carried
  residual     full when step >= the next scheduled step (the gap ramps 1, 2, ... up to cache_interval);
               taylorseer's factors of the span's residual (output - hidden input), the next full step
               and the gap carried; a cached step adds the prediction to the first block's output

Graph inputs, each with a default that caches nothing (every step runs the span: the plain Loop's
image bit for bit): ``cache_interval`` (int64), ``cache_threshold`` (double). The interval and the
threshold are run-time choices; the method and its structure (deepcache's BRANCH, taylorseer's ORDER)
are the compiled graph's. Output ``cache_computed`` (bool, one per step): whether the span ran.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from .graph_backbone import BACKBONE_IO, inline_backbone, load_component

PIECES = ("cache_first/", "cache_rest/", "cache_tail/")
F, I64, F64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE, TensorProto.BOOL


def _piece(model, prefix: str):
    g = model.graph
    ins, outs = [i.name for i in g.input], [o.name for o in g.output]
    return load_component(model, {"out": outs[0], **{f"in:{k}": v for k, v in enumerate(ins)}}, prefix), ins, outs


def cache_inputs() -> list:
    return [helper.make_tensor_value_info("cache_interval", I64, []),
            helper.make_tensor_value_info("cache_threshold", F64, [])]


def cache_prologue(b, pre: dict, spec, sg) -> None:
    """Constants and the initial carried state; `spec` a runtime.cache.CacheSpec, `sg` the SplitGraphs."""
    pieces = [_piece(m, p) for m, p in zip((sg.first, sg.rest, sg.tail), PIECES)]
    b.const("cache_interval", np.array(1, np.int64))
    b.const("cache_threshold", np.array(0.0, np.float64))
    fold_constants(b)
    for name, v in (("zero", 0), ("minus_one", -1), ("warmup", spec.warmup), ("cap", spec.order + 1)):
        b.const(f"cache_{name}_i64", np.array(v, np.int64))
    b.const("cache_zero_f", np.array(0.0, np.float32))  # every float state starts as this broadcast zero
    b.const("cache_zero_d", np.array(0.0, np.float64))
    # the span's output: float, or (DeepCache on an int8-static UNet) the quantized tensor the next block reads
    span_type = sg.rest.graph.output[0].type.tensor_type.elem_type or F
    if spec.method == "deepcache":
        zero = "cache_zero_f"
        if span_type != F:
            zero = "cache_zero_span"
            b.const(zero, np.array(0, helper.tensor_dtype_to_np_dtype(span_type)))
        state = [(zero, span_type, "cache_feature")]
    elif spec.method in ("taylorseer", "residual"):
        state = [("cache_zero_f", F, f"cache_factor{k}") for k in range(spec.order + 1)]
        state += [("cache_zero_i64", I64, "cache_count"), ("cache_minus_one_i64", I64, "cache_last")]
        for k in range(1, spec.order + 1):
            b.const(f"cache_k{k}", np.array(k, np.int64))
            b.const(f"cache_fact{k}", np.array(math.factorial(k), np.float64))
        b.const("cache_k0", np.array(0, np.int64))
        if spec.method == "residual":  # the ramp: next full step 0, first gap 1
            state += [("cache_zero_i64", I64, "cache_next"), ("cache_one_i64", I64, "cache_gap")]
    else:
        state = [("cache_zero_f", F, "cache_prev"), ("cache_zero_f", F, "cache_residual")]
    pre["cache"] = {"spec": spec, "sg": sg, "pieces": pieces, "state": state, "span_type": span_type,
                    "inits": pieces[0][0].initializers + pieces[2][0].initializers,
                    "functions": [f for p in pieces for f in p[0].functions]}


def loop_state(pre: dict) -> dict[str, list]:
    """What the sampler's Loop carries for the cache: body inputs/outputs, Loop inputs/outputs, graph outputs."""
    c = pre.get("cache")
    if c is None:
        return {k: [] for k in ("body_in", "body_out", "loop_in", "loop_out", "graph_out")}
    st = c["state"]
    return {"body_in": [helper.make_tensor_value_info(f"{s}_in", t, None) for _, t, s in st],
            "body_out": [helper.make_tensor_value_info(f"{s}_out", t, None) for _, t, s in st]
                        + [helper.make_tensor_value_info("cache_computed_step", BOOL, [])],
            "loop_in": [init for init, _, _ in st],
            "loop_out": [f"{s}_final" for _, _, s in st] + ["cache_computed"],
            "graph_out": [helper.make_tensor_value_info("cache_computed", BOOL, ["steps_run"])]}


def _branch(b, name: str, build, types: list[int], inits=None):
    """An If branch: `build(sub)` appends nodes to a fresh builder and returns its outputs' names."""
    sub = type(b)()
    outs = build(sub)
    names = [sub.op("Identity", [t], f"{name}_o{k}") for k, t in enumerate(outs)]
    return helper.make_graph(sub.nodes, name, [], [helper.make_tensor_value_info(n, ty, None)
                                                   for n, ty in zip(names, types)], initializer=inits)


def _if(b, cond: str, then_build, else_build, outs: list[str], types: list[int], rest) -> list[str]:
    then = _branch(b, "cache_compute", then_build, types, rest.initializers)  # weights local: ORT pre-packs them
    other = _branch(b, "cache_reuse", else_build, types)
    b.nodes.append(helper.make_node("If", [cond], outs, name="cache_switch", then_branch=then, else_branch=other))
    return outs


def cached_call(b, pre: dict, bb, remap: dict[str, str], i: str) -> str:
    """first -> If(full: rest | carried stand-in) -> tail inlined in a Loop body; returns the backbone output."""
    c = pre["cache"]
    (first, f_in, f_out), (rest, r_in, _), (tail, t_in, _) = c["pieces"]
    feed = {BACKBONE_IO[role] if role in ("sample", "timestep") else role.split(":", 1)[1]: remap[name]
            for role, name in bb.io.items() if name in remap}
    inline_backbone(b.nodes, first, {PIECES[0] + n: feed[n] for n in f_in}, "")
    got = {n: feed[n] if n in f_in else PIECES[0] + n for n in f_out}  # a graph input passes straight through

    def run_rest(sub) -> str:
        return inline_backbone(sub.nodes, rest, {PIECES[1] + n: got[n] for n in r_in}, "")

    method = c["spec"].method
    full, span = _POLICIES[method](b, c, got, i, run_rest, rest)
    b.op("Identity", [full], "cache_computed_step")
    binding = {PIECES[2] + n: span if n == c["sg"].span_outputs[0] else got[n] if n in got else feed[n] for n in t_in}
    return inline_backbone(b.nodes, tail, binding, "")


def _deep(b, c, got, i, run_rest, rest):
    full = b.op("Equal", [b.op("Mod", [i, "cache_interval"], "cache_phase"), "cache_zero_i64"], "cache_full")
    span, = _if(b, full, lambda s: [run_rest(s)], lambda s: ["cache_feature_in"], ["cache_span"], [c["span_type"]], rest)
    b.op("Identity", [span], "cache_feature_out")
    return full, span


def _taylor(b, c, got, i, run_rest, rest):
    order = c["spec"].order
    factors = [f"cache_factor{k}_in" for k in range(order + 1)]
    warm = b.op("Less", [i, "cache_warmup_i64"], "cache_warm")
    since = b.op("Sub", [b.op("Sub", [i, "cache_warmup_i64"], "cache_after_warmup"), "cache_one_i64"], "cache_since")
    due = b.op("Equal", [b.op("Mod", [since, "cache_interval"], "cache_phase"), "cache_zero_i64"], "cache_due")
    empty = b.op("Equal", ["cache_count_in", "cache_zero_i64"], "cache_empty")
    full = b.op("Or", [b.op("Or", [warm, due], "cache_warm_or_due"), empty], "cache_full")
    gap = b.op("Sub", [i, "cache_last_in"], "cache_gap")

    def compute(s) -> list[str]:
        out = run_rest(s)
        return [out, *_taylor_update(s, out, factors, gap, order), i]

    def predict(s) -> list[str]:
        return [_taylor_predict(s, factors, gap, order), *factors, "cache_count_in", "cache_last_in"]

    outs = ["cache_span", *[f"cache_factor{k}_out" for k in range(order + 1)], "cache_count_out", "cache_last_out"]
    span, *_ = _if(b, full, compute, predict, outs, [F] * (order + 2) + [I64, I64], rest)
    return full, span


def _taylor_update(s, value: str, factors: list[str], gap: str, order: int) -> list[str]:
    """runtime.cache._Taylor.update: the new factors (finite differences over full steps) and their count."""
    new = [value]
    gap_f = s.op("Cast", [gap], "cache_gap_f", to=F)
    for k in range(order):
        diff = s.op("Div", [s.op("Sub", [new[k], factors[k]], f"cache_delta{k}"), gap_f], f"cache_diff{k}")
        have = s.op("Less", [f"cache_k{k}", "cache_count_in"], f"cache_have{k}")
        new.append(s.op("Where", [have, diff, factors[k + 1]], f"cache_new{k + 1}"))
    count = s.op("Min", [s.op("Add", ["cache_count_in", "cache_one_i64"], "cache_count1"), "cache_cap_i64"],
                 "cache_count_next")
    return [*new, count]


def _taylor_predict(s, factors: list[str], gap: str, order: int) -> str:
    """runtime.cache._Taylor.predict: the factors' series at `gap` steps past the last full step."""
    gap_d = s.op("Cast", [gap], "cache_gap_d", to=F64)
    pred, power = factors[0], None
    for k in range(1, order + 1):
        power = gap_d if power is None else s.op("Mul", [power, gap_d], f"cache_pow{k}")
        coef = s.op("Cast", [s.op("Div", [power, f"cache_fact{k}"], f"cache_coef{k}_d")], f"cache_coef{k}", to=F)
        term = s.op("Add", [pred, s.op("Mul", [factors[k], coef], f"cache_term{k}")], f"cache_sum{k}")
        have = s.op("Less", [f"cache_k{k}", "cache_count_in"], f"cache_use{k}")
        pred = s.op("Where", [have, term, pred], f"cache_pred{k}")
    return pred


def _residual(b, c, got, i, run_rest, rest):
    order = c["spec"].order
    hidden = got[c["sg"].hidden_in[0]]
    factors = [f"cache_factor{k}_in" for k in range(order + 1)]
    full = b.op("GreaterOrEqual", [i, "cache_next_in"], "cache_full")
    gap = b.op("Sub", [i, "cache_last_in"], "cache_gap")

    def compute(s) -> list[str]:
        out = run_rest(s)
        new = _taylor_update(s, s.op("Sub", [out, hidden], "cache_new_residual"), factors, gap, order)
        ramp = s.op("Min", [s.op("Add", ["cache_gap_in", "cache_one_i64"], "cache_gap1"), "cache_interval"],
                    "cache_gap_next")
        return [out, *new, i, s.op("Add", [i, "cache_gap_in"], "cache_next_full"), ramp]

    def predict(s) -> list[str]:
        span = s.op("Add", [hidden, _taylor_predict(s, factors, gap, order)], "cache_predicted")
        return [span, *factors, "cache_count_in", "cache_last_in", "cache_next_in", "cache_gap_in"]

    outs = ["cache_span", *[f"cache_factor{k}_out" for k in range(order + 1)], "cache_count_out", "cache_last_out",
            "cache_next_out", "cache_gap_out"]
    span, *_ = _if(b, full, compute, predict, outs, [F] * (order + 2) + [I64] * 4, rest)
    return full, span


def _first_block(b, c, got, i, run_rest, rest):
    sg = c["sg"]
    hidden, probe = got[sg.hidden_in[0]], got[sg.probe[0]]
    r = b.op("Sub", [hidden, probe], "cache_r")
    moved = fold_sum(b, b.op("Abs", [b.op("Sub", [r, "cache_prev_in"], "cache_dr")], "cache_abs_dr"), "cache_fold_dr")
    size = fold_sum(b, b.op("Abs", ["cache_prev_in"], "cache_abs_prev"), "cache_fold_prev")
    ratio = b.op("Cast", [b.op("Div", [moved, size], "cache_ratio_f")], "cache_ratio", to=F64)
    first = b.op("Equal", [i, "cache_zero_i64"], "cache_first_step")
    changed = b.op("Greater", [ratio, "cache_threshold"], "cache_changed")
    off = b.op("Not", [b.op("Greater", ["cache_threshold", "cache_zero_d"], "cache_on")], "cache_off")
    full = b.op("Or", [b.op("Or", [first, changed], "cache_first_or_changed"), off], "cache_full")

    def compute(s) -> list[str]:
        out = run_rest(s)
        return [out, s.op("Sub", [out, hidden], "cache_new_residual"), r]

    def reuse(s) -> list[str]:
        return [s.op("Add", [hidden, "cache_residual_in"], "cache_reused"), "cache_residual_in", "cache_prev_in"]

    span, _, _ = _if(b, full, compute, reuse, ["cache_span", "cache_residual_out", "cache_prev_out"], [F, F, F], rest)
    return full, span


_POLICIES = {"deepcache": _deep, "taylorseer": _taylor, "first_block": _first_block, "residual": _residual}


def fold_constants(b) -> None:
    """The constants fold_sum reads, added once (step caching and adaptive stopping both fold)."""
    have = {t.name for t in b.inits}
    for name, value in (("cache_one_i64", np.array(1, np.int64)), ("cache_two_i64", np.array(2, np.int64)),
                        ("cache_flat", np.array([-1], np.int64)), ("cache_scalar", np.zeros((0,), np.int64)),
                        ("cache_head", np.array([0], np.int64))):
        if name not in have:
            b.const(name, value)


def fold_sum(b, x: str, tag: str) -> str:
    """cache_math.fold_sum's twin: a Loop halving the flattened tensor (one zero appended to an odd length)."""
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
