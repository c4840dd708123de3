"""What an fp8 / nvfp4 recipe quantizes, and which linears it keeps 16-bit (measured, within a budget).

    plan = plan_lowbit(ctx, recipe)   # nodes to quantize, nodes kept 16-bit, activation ranges, report

The candidates are the recipe's Conv / MatMul / Gemm nodes with constant weights outside its
`keep_float` patterns. With `keep_16bit=auto` (configs_float.LowbitRecipe) the search is the mixed
int8 recipe's (sensitivity.py): the probe images with every candidate quantized first; when they
miss the target (plus `margin_db`), each candidate quantized alone on calibration feeds, ranked by
the output error it adds per weight byte, and the smallest prefix of that ranking whose 16-bit
copy brings the probe there, within `max_16bit` of the candidates' weight bytes. Quality is
always measured on the graph that computes what the stored file computes (`measured_graph`): FP8 / NVFP4 numpy-twin
weights, FP8 activation Q/DQ or activations rounded through float16, and the kept layers' float16
weights with inputs rounded through float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from .calibration import step_ranges
from .graphs import quantizable_nodes
from .lowbit_graphs import simulation_graph
from .static_plan import selection


@dataclass
class LowbitPlan:
    nodes: list[str]  # quantized to the low-bit format
    keep16: list[str]  # candidates kept 16-bit (float16 weights)
    kept: list[str]  # quantizable nodes left float by keep_float patterns
    ranges: dict[str, tuple[float, float]]  # calibrated ranges of the quantized nodes' inputs ({} when not needed)
    details: dict = field(default_factory=dict)


def weight_formats(recipe) -> tuple[str, str]:
    """(weights, activations) as simulation_graph names them."""
    if recipe.name == "fp8":
        return "fp8", "fp8"
    return "nvfp4", recipe.activations


def measured_graph(model: onnx.ModelProto, recipe, nodes: list[str], ranges: dict, keep16=()) -> onnx.ModelProto:
    """The fp32 graph ONNX Runtime's CPU provider runs to measure what the stored low-bit file computes."""
    weights, activations = weight_formats(recipe)
    return simulation_graph(model, nodes, weights, activations, ranges, keep16)


def input_ranges(ctx, nodes: list[str]) -> dict[str, tuple[float, float]]:
    """Per-tensor ranges of the nodes' data inputs over every calibration step (the union)."""
    by_name = {n.name: n for n in ctx.unet.graph.node}
    tensors = list(dict.fromkeys(by_name[n].input[0] for n in nodes))
    calib = ctx.get_calibration()
    ctx.log(f"calibrating {len(tensors)} activations of {len(nodes)} nodes over {calib.num_steps} steps x {calib.rows} rows")
    return step_ranges(ctx.unet, tensors, calib, ctx.threads).aggregate(None, "max")


def budget_prefix(ranked: list[str], cost: dict[str, int], fraction: float) -> int:
    """The longest prefix of `ranked` whose cost stays within `fraction` of the total."""
    limit, spent, k = fraction * sum(cost.values()), 0, 0
    for n in ranked:
        if spent + cost[n] > limit:
            break
        spent += cost[n]
        k += 1
    return k


def choose_16bit(ctx, recipe, nodes: list[str], ranges: dict, cost: dict[str, int]) -> tuple[list[str], dict]:
    """(nodes kept 16-bit, report): the smallest sensitivity-ranked set reaching the target within the budget."""
    from .sensitivity import probe_trace, rank_nodes, smallest_prefix

    target = recipe.target_db + recipe.margin_db  # on the probe
    probe = ctx.get_probe()
    state: dict = {"ranked": list(nodes)}

    def build(keep: set[str]) -> onnx.ModelProto:
        return measured_graph(ctx.unet, recipe, [n for n in nodes if n not in keep], ranges, sorted(keep, key=nodes.index))

    probe_k, trace = probe_trace(probe, build, state["ranked"], ctx.log)
    sens: dict[str, float] = {}
    steps: list[int] = []
    if probe_k(0) >= target:
        k, reached, max_k = 0, True, 0
    else:
        ranked, sens, steps = rank_nodes(ctx, ctx.get_calibration(), nodes,
                                         lambda n: measured_graph(ctx.unet, recipe, [n], ranges), recipe.sensitivity_steps, cost)
        first = probe_k(0)
        probe_k, trace = probe_trace(probe, build, ranked, ctx.log, known={0: first})
        state["ranked"] = ranked
        max_k = budget_prefix(ranked, cost, recipe.max_16bit)
        ctx.log(f"16-bit search: probe target {target:.1f} dB (all quantized: {first:.2f}); budget {recipe.max_16bit:.0%} "
                f"of the weight bytes = the top {max_k} of {len(ranked)}")
        k, reached = smallest_prefix(probe_k, target, max_k)
    chosen = state["ranked"][:k]
    total = sum(cost.values())
    kept_bytes = sum(cost[n] for n in chosen)
    report = {
        "mode": recipe.keep_16bit, "target_psnr_db": recipe.target_db, "margin_db": recipe.margin_db,
        "target_reached_on_probe": reached,
        "budget_fraction": recipe.max_16bit, "budget_nodes": max_k,
        "nodes": chosen, "node_count": len(chosen), "candidates": len(nodes),
        "weight_bytes_fraction": round(kept_bytes / total, 4) if total else 0.0,
        "weight_bytes_16bit_fp32": int(kept_bytes), "weight_bytes_candidates_fp32": int(total),
        "probe": {"prompts": len(probe.prompts), "seed": probe.seed, **probe.kwargs, "trace": trace(),
                  "note": "calibration prompts and seeds, not held-out"},
    }
    if sens:
        report["sensitivity_steps"] = [int(s) for s in steps]
        report["ranking"] = [{"node": n, "added_relative_mse": sens[n], "weight_bytes_fp32": int(cost[n])}
                             for n in state["ranked"][:max(len(chosen), 20)]]
    if not reached:
        ctx.log(f"16-bit search: the target {target:.1f} dB is not reached within max_16bit={recipe.max_16bit} "
                f"({len(chosen)} layers, {report['weight_bytes_fraction']:.1%} of the weight bytes, kept)")
    return chosen, report


def plan_lowbit(ctx, recipe) -> LowbitPlan:
    nodes, kept = selection(ctx.unet, recipe, recipe.op_types)
    ranges = input_ranges(ctx, nodes) if recipe.calibrated else {}
    if not recipe.searches:
        why = ("none: every candidate quantized" if recipe.keep_16bit == "none"
               else "none: dynamic FP4 activations have no CPU simulation to measure a search on")
        return LowbitPlan(nodes, [], kept, ranges, {"keep_16bit": {"mode": recipe.keep_16bit, "nodes": [], "decision": why}})
    cost = {q.name: 4 * q.weight_size for q in quantizable_nodes(ctx.unet, recipe.op_types, recipe.keep_float)}
    keep16, report = choose_16bit(ctx, recipe, nodes, ranges, cost)
    quantized = [n for n in nodes if n not in set(keep16)]
    return LowbitPlan(quantized, keep16, kept, ranges, {"keep_16bit": report})
