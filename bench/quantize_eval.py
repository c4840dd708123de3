"""Acceptance measurements for `onnxdiffusion quantize` (issue 5) on an exported model folder.

    .venv/bin/python bench/quantize_eval.py [--model models/shapes-sd-onnx] [--count 64]

For every recipe: quantize into --work/<name>, generate the held-out prompts (seed i for prompt
i, DDIM 20 steps, guidance 4) with the fp32 and the quantized folder, and report image PSNR vs
fp32 (mean over images), the judge's strict and attribute accuracy, backbone file size ratio,
backbone latency (median of interleaved runs, one thread, at several guided batch sizes), float
nodes, and the Loop form's agreement with the host loop. Also: the --correct MSE closure, and
whether two runs give byte-identical files. Writes bench/results/quantize.json and a Markdown
table (bench/results/quantize.md), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.artifacts import sha256_file  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.loops import compile_loop  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import latency  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

# (label, recipe name, options, correct: False or the correction method)
RUNS = [
    ("int8-static", "int8-static", {}, False),
    ("int8-naive", "int8-naive", {}, False),
    ("int8-timestep", "int8-timestep", {"groups": "4"}, False),
    ("int8-static+correct", "int8-static", {}, "trajectory"),
    ("int8-static+correct-output", "int8-static", {}, "output"),
    ("mixed", "mixed", {"target_psnr": "36"}, False),
    ("mixed-45dB", "mixed", {"target_psnr": "45"}, False),
    ("int4-weights", "int4-weights", {}, False),
    ("int4-weights+int8", "int4-weights", {"others": "int8"}, False),
    ("int8-dynamic", "int8-dynamic", {}, False),
    ("fp16", "fp16", {}, False),
    ("int8-static-entropy", "int8-static", {"calibrator": "entropy"}, False),
    ("int8-static-mean", "int8-static", {"aggregation": "mean"}, False),
]
LATENCY_BATCHES = (1, 4, 16)  # images; the backbone sees twice as many rows (uncond + cond)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def generate(folder: Path, scenes, options: EvaluateOptions, loop: str | None = None) -> np.ndarray:
    """loop None: the evaluation path (batches of options.batch); else one batch through that loop form."""
    pipe = Pipeline.from_folder(folder, threads=1)
    if loop is None:
        return generate_set(pipe, scenes, options, progress=False)
    from onnxdiffusion.evaluate.run import item_latents

    shape = pipe.latent_shape_for(1)[1:]
    lat = item_latents(shape, list(range(len(scenes))))
    return pipe([sc.caption for sc in scenes], steps=options.steps, sampler=options.sampler, guidance=options.guidance,
                batch=len(scenes), latents=lat, loop=loop).images


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "shapes-sd-onnx")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "quantize")
    ap.add_argument("--count", type=int, default=128, help="held-out prompt-seed pairs (seeds 0..count-1)")
    ap.add_argument("--calib-count", type=int, default=32)
    ap.add_argument("--loop-check", type=int, default=8, help="prompts generated again through the Loop form")
    ap.add_argument("--latency-runs", type=int, default=40)
    ap.add_argument("--only", nargs="*", help="labels of RUNS to run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quantize.json")
    ap.add_argument("--guidance", type=float, default=None,
                    help="default: the guidance the model card chose (models/shapes-sd/eval.json), else 4")
    args = ap.parse_args(argv)
    if args.guidance is None:
        card = ROOT / "models" / "shapes-sd" / "eval.json"
        try:
            args.guidance = float(json.loads(card.read_text())["options"]["guidance"])
        except (OSError, KeyError, ValueError, TypeError):
            args.guidance = 4.0

    args.work.mkdir(parents=True, exist_ok=True)
    options = EvaluateOptions(count=args.count, steps=20, sampler="ddim", guidance=args.guidance, batch=32)
    scenes = heldout_scenes(options)
    judge = Judge.from_file(threads=1)
    manifest = json.loads((args.model / "manifest.json").read_text())
    calib = CalibrationConfig(count=args.calib_count, steps=20, sampler="ddim", guidance=args.guidance)

    log(f"fp32 reference: {len(scenes)} held-out prompts")
    t0 = time.perf_counter()
    ref = generate(args.model, scenes, options)
    fp32_eval = evaluate_images(ref, scenes, judge)
    result = {
        "model": str(args.model),
        "stand_in": "shapes-sd" not in args.model.name,
        "settings": {"count": len(scenes), "split": "heldout", "steps": 20, "sampler": "ddim", "guidance": args.guidance,
                     "calibration": calib.to_dict(), "threads": 1, "latency_runs": args.latency_runs,
                     "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "fp32": {k: fp32_eval[k] for k in ("strict_accuracy", "attribute_accuracy", "frechet_distance")}
        | {"generate_seconds": round(time.perf_counter() - t0, 1)},
        "recipes": {},
    }
    runs = [r for r in RUNS if not args.only or r[0] in args.only]
    fp32_unet = args.model / manifest["components"]["unet"]["path"]
    for label, name, opts, correct in runs:
        out = args.work / label.replace("+", "_")
        log(f"{label}: quantize")
        t0 = time.perf_counter()
        cfg = QuantizeConfig(recipe=recipe_class(name).with_options(opts), calibration=calib, correct=bool(correct),
                             correct_method=correct or "trajectory", threads=1, latency_runs=args.latency_runs)
        report = quantize(args.model, out, cfg, overwrite=True, log=log)
        q_seconds = time.perf_counter() - t0
        log(f"{label}: generate")
        images = generate(out, scenes, options)
        ev = evaluate_images(images, scenes, judge)
        per_image = [psnr(a, b) for a, b in zip(images, ref)]
        mse = float(np.mean((images.astype(np.float64) - ref.astype(np.float64)) ** 2))
        per_image_mse = ((images.astype(np.float64) - ref.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
        img_mse = np.sort(per_image_mse)[::-1]
        worst = max(1, len(img_mse) // 10)
        log(f"{label}: loop form")
        compile_loop(out, out, form="loop")
        n = min(args.loop_check, len(scenes))
        host_imgs = generate(out, scenes[:n], options, loop="host")
        loop_imgs = generate(out, scenes[:n], options, loop="loop")
        loop_psnr = psnr(loop_imgs, host_imgs)
        log(f"{label}: latency sweep")
        lat = {}
        unet_new = out / "unet" / "model.onnx"
        for b in LATENCY_BATCHES:
            feed = component_feed("unet", manifest, batch=b)
            runs_b = max(15, args.latency_runs // b)
            t = latency({"fp32": fp32_unet, "new": unet_new}, feed, 1, runs_b)
            lat[f"rows{2 * b}"] = {"fp32_ms": round(t["fp32"]["median_ms"], 3), "new_ms": round(t["new"]["median_ms"], 3),
                                   "ratio": round(t["new"]["median_ms"] / t["fp32"]["median_ms"], 3), "runs": runs_b}
        entry = {
            "recipe": report["recipe"],
            "correct": correct,
            "psnr_db_mean": float(np.mean([p for p in per_image if math.isfinite(p)] or [math.inf])),
            "psnr_db_min": float(np.min(per_image)),
            "psnr_db_of_mean_mse": 10 * math.log10(255.0**2 / mse) if mse > 0 else math.inf,
            "image_mse": mse,
            "image_mse_per_image": [round(float(v), 6) for v in per_image_mse],
            # how concentrated the error is: a few images whose layout flipped dominate pooled MSE
            "mse_share_worst_10pct_images": float(img_mse[:worst].sum() / img_mse.sum()) if img_mse.sum() > 0 else None,
            "strict_accuracy": ev["strict_accuracy"],
            "attribute_accuracy": ev["attribute_accuracy"],
            "frechet_distance": ev["frechet_distance"],
            "unet_bytes": report["sizes"]["unet"]["bytes"] if "unet" in report["sizes"] else None,
            "unet_size_ratio": report["sizes"].get("unet", {}).get("ratio"),
            "latency_report": report["latency"].get("unet"),
            "latency_sweep": lat,
            "verdict": report["verdict"],
            "float_node_count": report["float_node_count"],
            "float_nodes": report["float_nodes"],
            "quantized_node_count": report["quantized_node_count"],
            "fused_ops": report["fused_ops"],
            "quality_on_calibration": report["quality"],
            "loop_vs_host_psnr_db": loop_psnr,
            "quantize_seconds": round(q_seconds, 1),
            "unet_sha256": sha256_file(unet_new),
            "details": {k: v for k, v in report["details"].items() if k != "ranking"} | (
                {"ranking_top": report["details"]["ranking"][:30]} if "ranking" in report["details"] else {}),
        }
        result["recipes"][label] = entry
        log(f"{label}: PSNR {entry['psnr_db_mean']:.2f} dB, strict {entry['strict_accuracy']:.3f}, "
            f"size {entry['unet_size_ratio']}x, latency {lat['rows2']['ratio']}x, loop/host {loop_psnr:.1f} dB")
        _write(args.out, result)

    # acceptance 7: quantize the static and timestep recipes again, compare bytes
    for label in ("int8-static", "int8-timestep"):
        if label not in result["recipes"]:
            continue
        name, opts = next((n, o) for lb, n, o, _ in RUNS if lb == label)
        again = args.work / f"{label}-again"
        cfg = QuantizeConfig(recipe=recipe_class(name).with_options(opts), calibration=calib, threads=1, latency_runs=3)
        quantize(args.model, again, cfg, overwrite=True)
        same = sha256_file(again / "unet" / "model.onnx") == result["recipes"][label]["unet_sha256"]
        result.setdefault("determinism", {})[label] = same
        log(f"{label}: second run byte-identical: {same}")
    _summaries(result)
    _write(args.out, result)
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


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


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(o):
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items() if not str(k).startswith("_")}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        if isinstance(o, (float, np.floating)):
            return float(o) if math.isfinite(o) else None
        if isinstance(o, np.integer):
            return int(o)
        return o

    path.write_text(json.dumps(clean(result), indent=2) + "\n")


def markdown(result: dict) -> str:
    f = result["fp32"]
    lines = [
        f"model: {result['model']}" + ("  (STAND-IN, not the embedded model)" if result["stand_in"] else ""),
        f"held-out prompt-seed pairs: {result['settings']['count']}, DDIM 20 steps, guidance {result['settings']['guidance']}, "
        f"calibration {result['settings']['calibration']['count']} calib-split prompts; latency: 1 thread, median",
        f"fp32: strict accuracy {f['strict_accuracy']:.3f}, attribute {f['attribute_accuracy']:.3f}, FD {f['frechet_distance']:.2f}",
        "",
        "| recipe | PSNR vs fp32 (dB) | strict acc | unet smaller | latency (1 img) | latency (4 img) | latency (16 img) | float nodes | loop vs host (dB) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, e in result["recipes"].items():
        sw = e["latency_sweep"]
        lp = e["loop_vs_host_psnr_db"]
        lines.append(
            f"| {label} | {e['psnr_db_mean']:.2f} | {e['strict_accuracy']:.3f} | {e['unet_size_ratio']}x | "
            f"{sw['rows2']['ratio']:.2f}x | {sw['rows8']['ratio']:.2f}x | {sw['rows32']['ratio']:.2f}x | "
            f"{e['float_node_count']} | {'inf' if lp is None or not math.isfinite(lp) else f'{lp:.1f}'} | {e['verdict']} |")
    s = result.get("summary", {})
    lines.append("")
    for k, v in s.items():
        lines.append(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}")
    for k, v in result.get("determinism", {}).items():
        lines.append(f"- {k} byte-identical across two runs: {v}")
    for k, v in result.get("acceptance", {}).items():
        lines.append(f"- acceptance {k}: {'PASS' if v else 'FAIL'}")
    schedule = ROOT / "bench" / "results" / "precision_schedule.md"  # the schedule vs --correct, both models
    if schedule.exists():
        lines += ["", schedule.read_text().rstrip("\n")]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
