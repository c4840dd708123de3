"""Mixed precision: rank nodes by the error their quantization adds, keep the fewest float that reach a target.

1. Sensitivity: quantize each candidate node alone and measure the mean squared error it adds to
   the backbone output on calibration feeds (a few timesteps spread over the trajectory, the
   recorded fp32 outputs as reference).
2. Search: with nodes sorted by sensitivity, find the smallest k such that keeping the top k in
   float gives image PSNR >= target on the probe prompts (full sampling runs against fp32
   images), by bisection over k.
"""

from __future__ import annotations

import math

import numpy as np

from .runner import backbone_outputs, session

MAX_SENSITIVITY_ROWS = 32


def choose_float_nodes(ctx, recipe, calib, nodes: list[str], quantize_only, quantize_without) -> dict:
    steps = calib.spread_steps(recipe.sensitivity_steps)
    rows = min(calib.rows, MAX_SENSITIVITY_ROWS)
    sub = type(calib)(calib.samples[:, :rows], calib.timesteps, calib.context[:rows], calib.outputs[:, :rows],
                      extras={k: v[:rows] for k, v in calib.extras.items()})
    ref = sub.outputs[steps].astype(np.float64)
    signal = float(np.mean(ref**2))
    ctx.log(f"sensitivity of {len(nodes)} nodes on {len(steps)} timesteps x {rows} rows")
    sens = {}
    for i, name in enumerate(nodes):
        got = backbone_outputs(session(quantize_only(name), ctx.threads), sub, steps)
        sens[name] = float(np.mean((got - ref) ** 2)) / signal
    ranked = sorted(nodes, key=lambda n: (-sens[n], nodes.index(n)))
    probe = ctx.get_probe()
    trace = []

    def probe_k(k: int) -> float:
        value = probe.psnr(quantize_without(set(ranked[:k])))
        trace.append({"float_nodes": k, "probe_psnr_db": round(value, 3) if math.isfinite(value) else None})
        ctx.log(f"  {k:4d} float nodes: probe PSNR {value:.2f} dB")
        return value

    target = recipe.target_psnr
    lo, hi = 0, len(ranked)
    if probe_k(0) >= target:
        hi = 0
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if probe_k(mid) >= target:
                hi = mid
            else:
                lo = mid
    chosen = ranked[:hi]
    full_sqnr = -10.0 * math.log10(max(sum(sens.values()), 1e-30))
    return {
        "float_nodes": chosen,
        "target_psnr_db": target,
        "probe": {"prompts": len(probe.prompts), "seed": probe.seed, **probe.kwargs, "trace": trace},
        "sensitivity_steps": [int(s) for s in steps],
        "ranking": [{"node": n, "added_relative_mse": sens[n],
                     "added_sqnr_db": round(-10 * math.log10(max(sens[n], 1e-30)), 2)} for n in ranked[:max(len(chosen), 20)]],
        "sum_of_single_node_errors_sqnr_db": round(full_sqnr, 2),
        "candidates": len(nodes),
    }

