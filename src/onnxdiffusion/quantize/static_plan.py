"""What an int8-static recipe quantizes: smoothing, op groups chosen by measured sensitivity, ranges.

    plan = plan_static(ctx, recipe, calib)   # graph to quantize, nodes, op types, per-step ranges

1. Smoothing (`smooth_alpha` > 0): per-channel |x| maxima of every quantized MatMul's input over
   the calibration trajectories; x / s and s W with SmoothQuant's s (see opgroups.apply_smoothing).
2. Op groups (opgroups.py): the weight linears minus the modulation linears are always quantized
   (the base); each further group is int8, float or auto. Auto groups are measured: each is
   quantized alone and the output error it adds on calibration feeds is compared with the base's
   (sensitivity.choose_groups). Fused attention is decomposed only when its matmuls are quantized.
3. Sensitive linears (`keep_sensitive` > 0): each quantized weight linear is quantized alone and
   the ones adding more than that share of all the linears' output error stay float.
Before 2 (`rotate` hadamard[:GROUP], after smoothing): the quantizable linears' inputs group-Hadamard
rotated, their weights rotated offline (rotation.py); everything after calibrates the rotated graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import UserError
from ..onnxio.files import copy as copy_model
from . import _ort, files
from .calibration import CalibrationSet, StepRanges, step_ranges
from .configs import Int8StaticRecipe
from ..onnxio.attention import decompose_attention
from .graphs import activation_tensors, quantizable_nodes, with_outputs
from .rotation import parse_rotate, rotate_linears
from .opgroups import (GROUP_OP_TYPES, NORM_OPS, apply_smoothing, attention_matmuls,
                       fused_attention_count, modulation_nodes, nodes_of, norm_constants_as_initializers, smoothable, smoothing_scales)

SENSITIVITY_STEPS = 4
WEIGHTLESS = ("attention", "softmax", "norms")
SPEED_MARGIN = 0.97  # a weightless group must make the call >= 3% faster to stay quantized
TIMING_RUNS = 15


@dataclass
class StaticPlan:
    model: onnx.ModelProto  # the graph to quantize (smoothed / attention decomposed as chosen)
    nodes: list[str]  # to quantize
    kept: list[str]  # quantizable weight linears kept float (keep_float patterns, float modulation)
    op_types: tuple[str, ...]
    tensors: list[str]
    stats: StepRanges
    details: dict = field(default_factory=dict)
    dynamic: list[str] = field(default_factory=list)  # weight linears with per-token dynamic activations


_copy = copy_model  # a ModelProto deep copy (onnxio.files)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return files.infer_shapes(model)  # a skeleton of a > 2 GB backbone too
    except Exception:  # noqa: BLE001 - the quantizer works without value_info, just less precisely
        return model


def channel_absmax(model: onnx.ModelProto, tensors: list[str], calib: CalibrationSet, threads: int = 1) -> dict[str, np.ndarray]:
    """Per-channel (last axis) max |x| of each tensor over every calibration step and row."""
    from .runner import session

    sess = session(with_outputs(model, tensors), threads)
    out: dict[str, np.ndarray] = {}
    for _, feed in calib.feeds(chunk=64):
        for name, v in zip(tensors, sess.run(tensors, feed)):
            m = np.abs(v.reshape(-1, v.shape[-1])).max(axis=0)
            out[name] = m if name not in out else np.maximum(out[name], m)
    return out


def smooth(model: onnx.ModelProto, calib: CalibrationSet, alpha: float, names: list[str], threads: int = 1) -> tuple[onnx.ModelProto, dict]:
    """SmoothQuant on the named constant-weight MatMuls (see opgroups.apply_smoothing)."""

    groups = smoothable(model, names)
    absmax = channel_absmax(model, list(groups), calib, threads)
    inits = {t.name: t for t in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    scales, spread = {}, []
    for x, mms in groups.items():
        weights = [files.array(model, inits[by_name[m].input[1]]) for m in mms]
        scales[x] = smoothing_scales(absmax[x], weights, alpha)
        a = absmax[x][absmax[x] > 0]
        if a.size:
            spread.append(float(a.max() / np.median(a)))
    smoothed, counts = apply_smoothing(model, scales)
    return _infer(smoothed), {"alpha": alpha, "inputs": len(scales), **counts,
                              "median_channel_outlier_ratio_before": round(float(np.median(spread)), 2) if spread else None}


def selection(model: onnx.ModelProto, recipe, op_types, allow_empty: bool = False) -> tuple[list[str], list[str]]:
    """(nodes to quantize, quantizable nodes kept float by the recipe's keep_float patterns)."""
    every = quantizable_nodes(model, op_types)
    chosen = quantizable_nodes(model, op_types, recipe.keep_float)
    if not chosen and not allow_empty:
        raise UserError(f"recipe {recipe.name}: no {'/'.join(op_types)} node with a constant weight to quantize")
    names = {q.name for q in chosen}
    return [q.name for q in chosen], [q.name for q in every if q.name not in names]


def _time_choices(ctx, recipe, calib, stats, base, groups, op_types, candidates: dict) -> dict[str, float]:
    """Median call time (ms, interleaved) of each candidate's QDQ backbone as ONNX Runtime's CPU provider runs it."""
    from .runner import decision_clock, session, time_sessions

    ranges = stats.aggregate(None, "max")
    sessions = {}
    for label, (graph, chosen) in candidates.items():
        nodes = base + [n for g in chosen for n in groups[g]]
        q = _ort.qdq_quantize(graph, ranges, nodes, op_types, recipe.activation_type, recipe.float_outputs)
        sessions[label] = session(q, ctx.threads)
    feed = calib.feed(calib.num_steps // 2, slice(0, min(calib.rows, 8)))
    # one thread: CPU time, which the machine's load does not move (wall time made this choice flip)
    times = time_sessions(sessions, feed, TIMING_RUNS, clock=decision_clock(ctx.threads))
    return {k: round(v["median_ms"], 3) for k, v in times.items()}


def sensitive_linears(ctx, recipe: Int8StaticRecipe, work: onnx.ModelProto, stats: StepRanges, calib: CalibrationSet,
                      linears: list[str], op_types: tuple[str, ...]) -> tuple[list[str], dict]:
    """The linears whose quantization alone adds more than `keep_sensitive` x the output error of all
    of them quantized together (relative output MSE on calibration feeds), most sensitive first."""
    from .sensitivity import probe_subset, rank_nodes, relative_error

    ranges = stats.aggregate(None, "max")

    def quantized(nodes):
        return _ort.qdq_quantize(work, ranges, nodes, op_types, recipe.activation_type, recipe.float_outputs)

    ranked, single, steps = rank_nodes(ctx, calib, linears, lambda n: quantized([n]), SENSITIVITY_STEPS)
    total = relative_error(quantized(linears), probe_subset(calib, SENSITIVITY_STEPS)[1], steps, ctx.threads)
    keep = [n for n in ranked if single[n] > recipe.keep_sensitive * total]
    ctx.log(f"keep float {len(keep)} linears adding > {recipe.keep_sensitive:g} x {total:.3g}: "
            + ", ".join(f"{n} {single[n]:.3g}" for n in keep))
    return keep, {"threshold_share": recipe.keep_sensitive, "all_linears_relative_mse": total, "float": keep,
                  "float_weight_bytes": sum(4 * q.weight_size for q in quantizable_nodes(work, op_types) if q.name in keep),
                  "ranking_top": [{"node": n, "added_relative_mse": single[n], "share": single[n] / total if total else None}
                                  for n in ranked[:10]]}


def dynamic_token(model: onnx.ModelProto, recipe: Int8StaticRecipe, calib: CalibrationSet,
                  threads: int = 1) -> tuple[onnx.ModelProto, dict]:
    """The weight linears int8-static would quantize, with per-token dynamic activations (dynamic_token.py):
    what is left to calibrate is the rest (convs, op groups). Float modulation stays float. `weights=gptq`:
    their int8 weights by GPTQ, the Hessians of the float inputs the codes quantize (rotated, when on)."""
    from .dynamic_token import dynamic_token_linears
    from .gptq import input_hessians

    ops = tuple(op for op in recipe.op_types if op in ("MatMul", "Gemm"))
    skip = set(modulation_nodes(model, recipe.op_types, recipe.keep_float)) if recipe.modulation == "float" else set()
    linears = [q.name for q in quantizable_nodes(model, ops, recipe.keep_float) if q.name not in skip]
    hessians, steps = None, []
    if getattr(recipe, "weights", "nearest") == "gptq":
        if files.is_large(model):
            raise UserError("int8-static weights=gptq runs the whole backbone for its Hessians: only backbones under 2 GB")
        steps = calib.spread_steps(recipe.gptq_steps)
        hessians = input_hessians(model, linears, calib, steps, threads)
    model, report = dynamic_token_linears(model, linears, zero_point=recipe.activations == "dynamic-token-asym",
                                          hessians=hessians)
    if hessians is not None:
        report.update(weights="gptq", gptq_timesteps=len(steps), hessian_inputs=len(hessians))
    report["nodes"] = linears
    return _infer(model), report


def plan_static(ctx, recipe: Int8StaticRecipe, calib: CalibrationSet) -> StaticPlan:
    from .sensitivity import choose_groups, probe_subset, relative_error

    details: dict = {}
    dynamic: list[str] = []
    model = ctx.unet
    if recipe.smooth_alpha > 0:
        mm = [q.name for q in quantizable_nodes(model, ("MatMul",), recipe.keep_float)]
        ctx.log(f"smoothing {len(mm)} MatMul inputs (alpha {recipe.smooth_alpha})")
        model, details["smoothing"] = smooth(model, calib, recipe.smooth_alpha, mm, ctx.threads)
    group = parse_rotate(recipe.rotate)
    if group:  # after smoothing: the rotation mixes the smoothed channels; calibration sees the rotated inputs
        linears = [q.name for q in quantizable_nodes(model, recipe.op_types, recipe.keep_float)]
        model, details["rotation"] = rotate_linears(model, linears, group)
        model = _infer(model)
        ctx.log(f"rotated the inputs of {details['rotation']['linears']} linears (Hadamard, group {group})")
    if getattr(recipe, "activations", "static").startswith("dynamic-token"):  # int8-static's option
        model, report = dynamic_token(model, recipe, calib, ctx.threads)
        dynamic = report.pop("nodes")
        details["dynamic_token"] = report
        ctx.log(f"per-token dynamic int8 activations for {report['linears']} linears"
                + (f", int8 weights by GPTQ ({report['gptq_timesteps']} timesteps' Hessians)" if "gptq_timesteps" in report else ""))
    weight_nodes, kept = selection(model, recipe, recipe.op_types, allow_empty="dynamic_token" in details)
    if not weight_nodes:  # every linear dynamic, the convs kept float: nothing to calibrate, op groups float
        empty = np.zeros((calib.num_steps, 0))
        why = {g: "float: no static linear left to calibrate against" for g in ("modulation", "attention", "softmax", "norms")}
        details["op_groups"] = {"quantized": [], "by_error": [], "decision": why, "sizes": {}, "base_linears": 0,
                                "budget": recipe.group_budget, "base_relative_mse": None, "added_relative_mse": {},
                                "attention": "fused (float)" if fused_attention_count(model) else "float"}
        return StaticPlan(model, [], kept, recipe.op_types, [], StepRanges([], empty, empty), details, dynamic)
    modulation = set(modulation_nodes(model, recipe.op_types, recipe.keep_float))
    base = [n for n in weight_nodes if n not in modulation]
    forced = {g: getattr(recipe, g) for g in ("modulation", "attention", "softmax", "norms")}
    fused = fused_attention_count(model)
    work = _infer(decompose_attention(model)) if fused and recipe.attention != "float" else model
    groups = {
        "modulation": [n for n in weight_nodes if n in modulation],
        "attention": attention_matmuls(work),
        "softmax": nodes_of(work, ("Softmax",)),
        "norms": nodes_of(work, NORM_OPS),
    }
    groups = {g: v for g, v in groups.items() if v and forced[g] != "float"}
    if "norms" in groups:
        work = norm_constants_as_initializers(_copy(work))
    every = base + [n for v in groups.values() for n in v]
    tensors = activation_tensors(work, every)
    ctx.log(f"calibrating {len(tensors)} activations of {len(every)} nodes over {calib.num_steps} steps x {calib.rows} rows")
    stats = step_ranges(work, tensors, calib, ctx.threads)
    all_ops = tuple(dict.fromkeys((*recipe.op_types, *(op for g in groups for op in GROUP_OP_TYPES[g]))))
    errors: dict[str, float] = {}
    base_error = None
    if any(forced[g] == "auto" for g in groups):
        ranges = stats.aggregate(None, "max")
        steps, sub = probe_subset(calib, SENSITIVITY_STEPS)

        def error_of(nodes):
            q = _ort.qdq_quantize(work, ranges, nodes, all_ops, recipe.activation_type, recipe.float_outputs)
            return relative_error(q, sub, steps, ctx.threads)

        base_error = error_of(base)
        for g, nodes in groups.items():
            errors[g] = error_of(nodes)
        ctx.log("op-group sensitivity (relative output MSE added alone): base " + f"{base_error:.3g}, "
                + ", ".join(f"{g} {e:.3g}" for g, e in errors.items()))
    chosen, why = choose_groups(errors, base_error or 0.0, recipe.group_budget, {g: forced[g] for g in groups})

    def graph_for(groups_in: list[str]) -> onnx.ModelProto:
        g = _infer(decompose_attention(model)) if "attention" in groups_in and fused else model
        return norm_constants_as_initializers(_copy(g)) if "norms" in groups_in else g

    def drop_orphans(groups_in: list[str]) -> list[str]:
        if "attention" not in groups_in and fused and "softmax" in groups_in:
            why["softmax"] = "float: attention stays fused (its matmuls are float)"
            return [g for g in groups_in if g != "softmax"]  # softmax exists only inside the decomposed attention
        return groups_in

    chosen = drop_orphans(chosen)
    by_error = list(chosen)
    # groups without weights save no bytes: an auto one stays only if the backbone gets faster with it
    weightless = [g for g in chosen if g in WEIGHTLESS and forced[g] == "auto"]
    if weightless:
        without = drop_orphans([g for g in chosen if g not in weightless])
        timing = _time_choices(ctx, recipe, calib, stats, base, groups, all_ops, {"with": (graph_for(chosen), chosen),
                                                                                 "without": (graph_for(without), without)})
        details["weightless_groups_latency_ms"] = timing
        if timing["with"] > SPEED_MARGIN * timing["without"]:
            for g in weightless:
                why[g] = f"float: quantizing it ({', '.join(weightless)}) is not faster ({timing['with']:.2f} vs {timing['without']:.2f} ms)"
            chosen = without
    work = graph_for(chosen)
    for g in forced:
        if g not in groups:
            why.setdefault(g, "float: forced" if forced[g] == "float" else "no such nodes in this graph")
    nodes = base + [n for g in chosen for n in groups[g]]
    op_types = tuple(dict.fromkeys((*recipe.op_types, *(op for g in chosen for op in GROUP_OP_TYPES[g]))))
    if recipe.keep_sensitive > 0:
        linears = [n for n in nodes if n in set(weight_nodes)]
        sensitive, details["sensitive_linears"] = sensitive_linears(ctx, recipe, work, stats, calib, linears, op_types)
        nodes = [n for n in nodes if n not in set(sensitive)]
        kept = kept + sensitive
    final_tensors = activation_tensors(work, nodes)
    index = {t: i for i, t in enumerate(stats.tensors)}
    idx = [index[t] for t in final_tensors]
    sub_stats = StepRanges(final_tensors, stats.lo[:, idx], stats.hi[:, idx])
    details["op_groups"] = {
        "quantized": chosen, "by_error": by_error, "decision": why, "sizes": {g: len(v) for g, v in groups.items()},
        "base_linears": len(base), "budget": recipe.group_budget,
        "base_relative_mse": base_error, "added_relative_mse": errors,
        "attention": "decomposed, matmuls int8" if "attention" in chosen else ("fused (float)" if fused else "float"),
    }
    kept = kept + [n for n in weight_nodes if n in modulation and "modulation" not in chosen]
    return StaticPlan(work, nodes, kept, op_types, final_tensors, sub_stats, details, dynamic)
