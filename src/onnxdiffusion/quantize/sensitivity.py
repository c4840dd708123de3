"""Mixed precision: rank nodes by the error their quantization adds, keep the fewest float that reach a target.

1. Sensitivity: quantize each candidate node alone and measure the mean squared error it adds to
   the backbone output on calibration feeds (a few timesteps spread over the trajectory, the
   recorded fp32 outputs as reference).
2. Search: with nodes sorted by sensitivity, find the smallest k such that keeping the top k in
   float gives image PSNR >= target on the probe prompts (full sampling runs against fp32
   images), by bisection over k.

The mixed int8 recipe and the fp8 / nvfp4 recipes' 16-bit layers (lowbit_plan.py) both use them.
"""

from __future__ import annotations

import fnmatch
import math

import numpy as np

from ..errors import UserError
from .runner import backbone_outputs, session

MAX_SENSITIVITY_ROWS = 32


def probe_subset(calib, n_steps: int):
    """(steps, calibration set cut to its first MAX_SENSITIVITY_ROWS rows): where sensitivities are measured."""
    steps = calib.spread_steps(n_steps)
    rows = min(calib.rows, MAX_SENSITIVITY_ROWS)
    sub = type(calib)(calib.samples[:, :rows], calib.timesteps, calib.context[:rows], calib.outputs[:, :rows],
                      extras={k: v[:rows] for k, v in calib.extras.items()})
    return steps, sub


def relative_error(model, sub, steps, threads: int = 1) -> float:
    """Mean squared error of the backbone output vs the recorded fp32 output, relative to its power."""
    ref = sub.outputs[steps].astype(np.float64)
    got = backbone_outputs(session(model, threads), sub, steps)
    return float(np.mean((got - ref) ** 2)) / float(np.mean(ref**2))


def choose_groups(errors: dict[str, float], base_error: float, budget: float, forced: dict[str, str]) -> tuple[list[str], dict]:
    """Which op groups to quantize: forced ones as told; auto ones in order of the error each adds
    alone (smallest first) while their sum stays within budget x the base linears' error."""
    chosen = [g for g, how in forced.items() if how == "int8"]
    spent, why = 0.0, {}
    for g in sorted((g for g, how in forced.items() if how == "auto"), key=lambda g: errors.get(g, math.inf)):
        e = errors.get(g, math.inf)
        if spent + e <= budget * base_error:
            chosen.append(g)
            spent += e
            why[g] = f"int8: adds {e:.3g} (budget left {budget * base_error - spent:.3g})"
        else:
            why[g] = f"float: adds {e:.3g} > budget left {max(budget * base_error - spent, 0):.3g}"
    for g, how in forced.items():
        if how != "auto":
            why[g] = f"{how}: forced"
    return chosen, why


def rank_nodes(ctx, calib, nodes: list[str], quantize_only, n_steps: int, cost: dict[str, float] | None = None):
    """(nodes most sensitive first, {node: added relative MSE}, timesteps): each node quantized alone,
    its error measured on calibration feeds; with `cost`, ranked by error per unit of cost (bytes)."""
    steps, sub = probe_subset(calib, n_steps)
    ctx.log(f"sensitivity of {len(nodes)} nodes on {len(steps)} timesteps x {sub.rows} rows")
    sens = {name: relative_error(quantize_only(name), sub, steps, ctx.threads) for name in nodes}
    order = {n: i for i, n in enumerate(nodes)}
    gain = (lambda n: sens[n] / max(cost[n], 1e-30)) if cost else (lambda n: sens[n])
    return sorted(nodes, key=lambda n: (-gain(n), order[n])), sens, steps


def smallest_prefix(probe_k, target: float, max_k: int, max_known_good: bool = False) -> tuple[int, bool]:
    """(smallest k in 0..max_k with probe_k(k) >= target, reached) by bisection over a ranking, the
    quality assumed to grow with k. Not reached: (max_k, False). `max_known_good`: max_k passes
    without a probe (every candidate float)."""
    if probe_k(0) >= target:
        return 0, True
    if max_k == 0 or (not max_known_good and probe_k(max_k) < target):
        return max_k, False
    lo, hi = 0, max_k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe_k(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, True


def probe_trace(probe, build, ranked: list[str], log, known: dict[int, float] | None = None):
    """(probe_k, rows): probe_k(k) is the image PSNR with the top k of `ranked` left out of
    quantization, memoized (`known`: values already measured); rows() the trace so far."""
    trace: dict[int, float] = dict(known or {})

    def probe_k(k: int) -> float:
        if k not in trace:
            trace[k] = probe.psnr(build(set(ranked[:k])))
            log(f"  {k:4d} float nodes: probe PSNR {trace[k]:.2f} dB")
        return trace[k]

    def rows() -> list[dict]:
        return [{"float_nodes": k, "probe_psnr_db": round(v, 3) if math.isfinite(v) else None} for k, v in trace.items()]

    return probe_k, rows


def choose_float_nodes(ctx, recipe, calib, nodes: list[str], quantize_only, quantize_without) -> dict:
    ranked, sens, steps = rank_nodes(ctx, calib, nodes, quantize_only, recipe.sensitivity_steps)
    probe = ctx.get_probe()
    probe_k, trace = probe_trace(probe, quantize_without, ranked, ctx.log)
    k, _ = smallest_prefix(probe_k, recipe.target_psnr, len(ranked), max_known_good=True)
    chosen = ranked[:k]
    full_sqnr = -10.0 * math.log10(max(sum(sens.values()), 1e-30))
    return {
        "float_nodes": chosen,
        "target_psnr_db": recipe.target_psnr,
        "probe": {"prompts": len(probe.prompts), "seed": probe.seed, **probe.kwargs, "trace": trace()},
        "sensitivity_steps": [int(s) for s in steps],
        "ranking": [{"node": n, "added_relative_mse": sens[n],
                     "added_sqnr_db": round(-10 * math.log10(max(sens[n], 1e-30)), 2)} for n in ranked[:max(len(chosen), 20)]],
        "sum_of_single_node_errors_sqnr_db": round(full_sqnr, 2),
        "candidates": len(nodes),
    }


def choose_8bit_weights(ctx, base, names: list[str], calib, quantize, fp32_bytes: int,
                        target_ratio: float, steps: int = 4) -> dict:
    """Which of `names` (MatMuls bound for 4-bit weights) get 8-bit weights: ranked by the output
    error each adds alone at 4 bits per byte 8 bits would cost, upgraded in that order while the
    backbone stays within fp32_bytes / target_ratio. `quantize(model, nodes, bits)` builds a candidate."""
    probe_steps, sub = probe_subset(calib, steps)
    ctx.log(f"4-bit sensitivity of {len(names)} MatMuls on {len(probe_steps)} timesteps x {sub.rows} rows")
    all4 = quantize(base, names, 4)
    budget = fp32_bytes / target_ratio - all4.ByteSize()
    if budget < 0:
        ctx.log(f"all-4-bit backbone is only {fp32_bytes / all4.ByteSize():.2f}x smaller: no room for 8-bit weights")
    err, cost = {}, {}
    for name in names:
        four = quantize(base, [name], 4)
        err[name] = relative_error(four, sub, probe_steps, ctx.threads)
        cost[name] = quantize(base, [name], 8).ByteSize() - four.ByteSize()  # measured: bytes of the 8-bit form
    ranked = sorted(names, key=lambda x: -err[x] / cost[x])
    chosen, spent = [], 0.0
    for name in ranked:
        if spent + cost[name] <= budget:
            chosen.append(name)
            spent += cost[name]
    return {"int8_weights": chosen, "budget_bytes": int(budget), "spent_bytes": int(spent),
            "error_sum_4bit": float(sum(err.values())), "error_sum_kept_4bit": float(sum(err[x] for x in names if x not in chosen)),
            "ranking": [{"node": x, "added_relative_mse": err[x], "bytes_for_8bit": int(cost[x])} for x in ranked[:30]]}


def named_8bit_weights(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """int4-weights' `weights_8bit`: the MatMuls bound for 4-bit weights (`names`) matching a pattern (fnmatch).
    A pattern that matches none is a user error: a typo would otherwise quietly leave every linear 4-bit."""
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise UserError(f"int4-weights weights_8bit: {p!r} matches no MatMul bound for 4-bit weights")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
