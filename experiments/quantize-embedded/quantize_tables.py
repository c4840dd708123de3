"""Tables and summaries for experiments/quantize-embedded/quantize_eval.py: issue 5's acceptance list (one model) and
issue 12's side-by-side table (several models)."""

from __future__ import annotations

import math

import numpy as np


def closure_stats(before: np.ndarray, after: np.ndarray, resamples: int = 2000) -> dict:
    """How robust a pooled-MSE closure is: pooled MSE concentrates in a few images (see
    mse_share_worst_10pct_images), so report a bootstrap interval over images, the per-image
    median, and how many images got better."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(before), (resamples, len(before)))
    boot = 1 - after[idx].sum(1) / np.maximum(before[idx].sum(1), 1e-12)
    keep = np.argsort(before)[: int(len(before) * 0.9)]
    return {"pooled": float(1 - after.sum() / before.sum()),
            "bootstrap_5_50_95": [round(float(v), 3) for v in np.percentile(boot, [5, 50, 95])],
            "median_per_image": float(np.median(1 - after / np.maximum(before, 1e-12))),
            "images_improved": float(np.mean(after < before)),
            "pooled_without_worst_10pct": float(1 - after[keep].sum() / before[keep].sum())}


def _summaries(result: dict) -> None:
    r = result["recipes"]
    s = {}
    if "int8-static" in r and "int8-naive" in r:
        s["static_minus_naive_db"] = r["int8-static"]["psnr_db_mean"] - r["int8-naive"]["psnr_db_mean"]
    if "int8-static" in r and "int8-timestep" in r:
        s["timestep_minus_static_db"] = r["int8-timestep"]["psnr_db_mean"] - r["int8-static"]["psnr_db_mean"]
        s["timestep_size_vs_static"] = r["int8-timestep"]["unet_bytes"] / r["int8-static"]["unet_bytes"]
    for label, key in (("int8-static+correct", "correct"), ("int8-static+correct-output", "correct_output")):
        if "int8-static" in r and label in r:
            m0, m1 = r["int8-static"]["image_mse"], r[label]["image_mse"]
            s[f"{key}_mse_closed_fraction"] = (m0 - m1) / m0 if m0 > 0 else None
            s[f"{key}_mean_psnr_gain_db"] = r[label]["psnr_db_mean"] - r["int8-static"]["psnr_db_mean"]
            s[f"{key}_mse_closed"] = closure_stats(np.array(r["int8-static"]["image_mse_per_image"]),
                                                   np.array(r[label]["image_mse_per_image"]))
            frac = (r[label].get("quality_on_calibration") or {}).get("backbone_error_affine_fraction")
            if frac is not None:
                s["static_backbone_error_affine_fraction"] = frac
    if "int8-static" in r and r["int8-static"].get("mse_share_worst_10pct_images") is not None:
        s["static_mse_share_worst_10pct_images"] = r["int8-static"]["mse_share_worst_10pct_images"]
    s["strict_accuracy_fp32"] = result["fp32"]["strict_accuracy"]
    result["summary"] = s
    # the acceptance list, item by item (None: not measured in this run)
    acc = {}
    st = r.get("int8-static")
    if st:
        acc["1_static_psnr_ge_30"] = st["psnr_db_mean"] >= 30
        acc["1_static_strict_within_2_points"] = abs(st["strict_accuracy"] - result["fp32"]["strict_accuracy"]) <= 0.02
        acc["1_static_size_ge_3.5x"] = (st["unet_size_ratio"] or 0) >= 3.5
        acc["1_static_latency_le_0.6x_one_image"] = st["latency_sweep"]["rows2"]["ratio"] <= 0.6
    if "static_minus_naive_db" in s:
        acc["2_static_beats_naive_by_3db"] = s["static_minus_naive_db"] >= 3
    if "timestep_minus_static_db" in s:
        acc["3_timestep_plus_1db_at_le_1.15x_size"] = s["timestep_minus_static_db"] >= 1 and s["timestep_size_vs_static"] <= 1.15
    if "mixed" in r:
        acc["4_mixed_ge_35db"] = r["mixed"]["psnr_db_mean"] >= 35
    for label in ("int4-weights", "int4-weights+int8"):
        if label in r:
            acc[f"5_{label}_ge_26db"] = r[label]["psnr_db_mean"] >= 26
    closed = [s[k] for k in ("correct_mse_closed_fraction", "correct_output_mse_closed_fraction") if s.get(k) is not None]
    if closed:
        acc["6_correct_closes_30pct_mse"] = max(closed) >= 0.3
    if result.get("determinism"):
        acc["7_byte_identical"] = all(result["determinism"].values())
    acc["8_loop_form_ge_60db_every_recipe"] = all(
        e["loop_vs_host_psnr_db"] is None or not math.isfinite(e["loop_vs_host_psnr_db"]) or e["loop_vs_host_psnr_db"] >= 60
        for e in r.values())
    result["acceptance"] = acc


def _fmt(v, spec=".2f", suffix=""):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:{spec}}{suffix}"


def markdown(result: dict) -> str:
    f = result["fp32"]
    st = result["settings"]
    lines = [
        f"### {result['model']} ({result.get('family', 'sd')}, backbone `{result.get('backbone', 'unet')}`)",
        "",
        f"held-out prompt-seed pairs: {st['count']}, {st.get('sampler', 'ddim')} {st['steps']} steps, guidance {st['guidance']}, "
        f"calibration {st['calibration']['count']} calib-split prompts; latency: 1 thread, median of interleaved runs",
        f"fp32: strict accuracy {f['strict_accuracy']:.3f}, attribute {f['attribute_accuracy']:.3f}, FD {f['frechet_distance']:.2f}",
        "",
        "| recipe | PSNR mean (dB) | worst image (dB) | strict acc | backbone smaller | latency (1 img) | latency (4 img) | "
        "latency (16 img) | float nodes | loop vs host (dB) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, e in result["recipes"].items():
        sw = e["latency_sweep"]
        lp = e["loop_vs_host_psnr_db"]
        lines.append(
            f"| {label} | {_fmt(e['psnr_db_mean'])} | {_fmt(e.get('psnr_db_min'))} | {e['strict_accuracy']:.3f} | "
            f"{e['unet_size_ratio']}x | {sw['rows2']['ratio']:.2f}x | {sw['rows8']['ratio']:.2f}x | {sw['rows32']['ratio']:.2f}x | "
            f"{e['float_node_count']} | {'inf' if lp is None or not math.isfinite(lp) else f'{lp:.1f}'} | {e['verdict']} |")
    groups = [(label, e["details"]["op_groups"]) for label, e in result["recipes"].items() if "op_groups" in e.get("details", {})]
    if groups:
        label, g = groups[0]
        lines += ["", f"op-group sensitivity ({label}; relative output MSE each group adds when quantized alone, on "
                  f"calibration trajectories; base = the weight linears always quantized): base "
                  f"{_fmt(g['base_relative_mse'], '.3g')}, " + ", ".join(f"{k} {_fmt(v, '.3g')}" for k, v in g["added_relative_mse"].items())]
        for label, g in groups:
            lines.append(f"- {label}: quantized groups {g['quantized'] or 'none'}; attention {g['attention']}")
            sens = result["recipes"][label]["details"].get("sensitive_linears")
            if sens:
                lines.append(f"  - kept float (each adds > {sens['threshold_share']:g} of all linears' error "
                             f"{_fmt(sens['all_linears_relative_mse'], '.3g')}): "
                             + (", ".join(f"{r['node']} {r['share']:.2f}" for r in sens["ranking_top"] if r["node"] in sens["float"]) or "none")
                             + f" ({sens['float_weight_bytes']} weight bytes)")
    carried = result.get("carried_over")
    if carried:
        lines += ["", f"rows taken from {carried['from']} (not measured again by the files joined after it): "
                  + ", ".join(carried["rows"])]
    s = result.get("summary", {})
    if s:
        lines.append("")
    for k, v in s.items():
        lines.append(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}")
    for k, v in result.get("determinism", {}).items():
        lines.append(f"- {k} byte-identical across two runs: {v}")
    for k, v in result.get("acceptance", {}).items():
        lines.append(f"- acceptance (issue 5) {k}: {'PASS' if v else 'FAIL'}")
    return "\n".join(lines)


def side_by_side(combined: dict) -> str:
    """One row per recipe, each model's numbers side by side."""
    models = combined["models"]
    names = list(models)
    labels = list(dict.fromkeys(label for r in models.values() for label in r["recipes"]))
    order = combined.get("order") or labels
    labels.sort(key=lambda x: order.index(x) if x in order else len(order))
    head = ["recipe"]
    for n in names:
        head += [f"{n}: mean dB", "worst dB", "strict", "smaller", "latency 1/4/16 img"]
    lines = ["## Quantization recipes, models side by side (images vs fp32 on held-out pairs)", "",
             "fp32 strict accuracy: " + ", ".join(f"{n} {r['fp32']['strict_accuracy']:.3f}" for n, r in models.items()), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        row = [label]
        for n in names:
            e = models[n]["recipes"].get(label)
            if e is None:
                row += ["-"] * 5
                continue
            sw = e["latency_sweep"]
            lat = "/".join(f"{sw[k]['ratio']:.2f}" for k in ("rows2", "rows8", "rows32")) + "x"
            if e.get("slower_than_fp32"):
                lat += " (slower)"
            row += [_fmt(e["psnr_db_mean"]), _fmt(e.get("psnr_db_min")), f"{e['strict_accuracy']:.3f}",
                    f"{e['unet_size_ratio']}x", lat]
        lines.append("| " + " | ".join(row) + " |")
    carried = {n: r["carried_over"] for n, r in models.items() if r.get("carried_over")}
    if carried:
        lines.append("")
    for n, c in carried.items():
        lines.append(f"- {n}: rows taken from {c['from']} (not measured again by the files joined after it): {', '.join(c['rows'])}")
    acc = combined.get("acceptance_issue12") or {}
    if acc:
        lines.append("")
    for k, v in acc.items():
        lines.append(f"- acceptance (issue 12) {k}: {'PASS' if v else 'FAIL'}")
    return "\n".join(lines)
