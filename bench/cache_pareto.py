"""Step caching's Pareto on both embedded models (issue 25, acceptance 3).

    .venv/bin/python bench/cache_pareto.py [--models sd mmdit] [--count 32] [--specs SPEC ...]
    .venv/bin/python bench/cache_pareto.py --int8 WORK [--specs SPEC ...] --out bench/results/cache_pareto_int8

Per model, at its evaluation settings (sd: ddim 20 steps guidance 4; mmdit: flow_euler 20 steps
guidance 3), the held-out prompt-seed pairs are generated at batch 1 on one thread uncached and with
each cache setting (DeepCache for the UNet, first-block cache, TaylorSeer and the residual cache for the MMDiT), the
settings interleaved prompt by prompt so load drift hits all alike.  Reported per setting: the
speed-up vs uncached at equal steps (CPU time per image, end to end: text encoding + sampling +
decoding; the median of per-prompt ratios and the ratio of totals), PSNR vs the uncached image
(mean, worst), the judge's strict accuracy (and its difference to uncached, in points) and how many
of the 20 steps ran the full backbone.  Writes bench/results/cache_pareto.{json,md,png}.

``--int8 WORK``: the cache settings run on the model's int8-static folder (WORK/<folder>-int8-static, built
with ``onnxdiffusion quantize --recipe int8-static`` when missing), beside fp32 and int8 uncached: each row's
speed-up, PSNR and strict points are given vs int8 uncached (the gate's reference) and vs fp32 uncached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.folder.artifacts import write_json  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, heldout_scenes, item_latents  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.techniques import caching as cache_mod  # noqa: E402

MODELS = {
    "sd": ("models/shapes-sd-onnx", "ddim", 20, 4.0,
           ["deepcache:2", "deepcache:3", "deepcache:4", "deepcache:5", "deepcache:3:2"]),
    "mmdit": ("models/shapes-mmdit-onnx", "flow_euler", 20, 3.0,
              ["first_block:0.05", "first_block:0.1", "first_block:0.15", "first_block:0.2", "first_block:0.3",
               "first_block:0.4", "taylorseer:2", "taylorseer:3", "taylorseer:2:2", "taylorseer:3:2", "taylorseer:4:2",
               "taylorseer:5:2", "residual:3", "residual:4", "residual:5"]),
}
GATE_SPEEDUP, GATE_PSNR, GATE_POINTS = 1.8, 30.0, 1.0
GATE_SPEEDUP_INT8 = 2.0  # issue 25: int8-static + cache >= 2x on top of int8 at the same PSNR / strict gate


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    m = re.search(r"model name\s*:\s*(.+)", text)
    flags = re.search(r"flags\s*:\s*(.+)", text)
    isa = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx", "avx2")))
    import onnxruntime

    return {"cpu": m.group(1).strip() if m else platform.processor(), "isa": isa, "cores": os.cpu_count(),
            "onnxruntime": onnxruntime.__version__, "load_before": os.getloadavg()[0]}


def int8_folder(folder: str, work: Path) -> Path:
    """The model's int8-static sibling under `work`, quantized (default calibration) when missing."""
    out = work / f"{Path(folder).name}-int8-static"
    if not (out / "manifest.json").exists():
        log(f"quantizing {folder} -> {out} (int8-static)")
        subprocess.run([sys.executable, "-m", "onnxdiffusion.cli", "quantize", str(ROOT / folder), str(out),
                        "--recipe", "int8-static", "--threads", "1", "--latency-runs", "5"], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return out


def calibrated(folder: Path, sampler: str, steps: int, guidance: float) -> None:
    """MagCache's ratios in `folder`'s manifest (`onnxdiffusion cache calibrate`, the evaluation settings, its
    built-in prompts, not the held-out ones) when missing."""
    if "magcache" not in json.loads((folder / "manifest.json").read_text()):
        log(f"calibrating MagCache's ratios of {folder}")
        subprocess.run([sys.executable, "-m", "onnxdiffusion.cli", "cache", "calibrate", str(folder), "--steps",
                        str(steps), "--sampler", sampler, "--guidance", str(guidance), "--threads", "1"], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def _count_full():
    """Wrap the cache's model function to count full-backbone steps of the last generation."""
    counts = []
    original = cache_mod.CachedBackbone.__call__

    def counting(self, x, t):
        out = original(self, x, t)
        if self.step == 1:
            counts.append(0)
        counts[-1] = self.computed
        return out

    cache_mod.CachedBackbone.__call__ = counting
    return counts


def _generate_all(pipes: dict, settings: list, scenes, sampler: str, steps: int, guidance: float, name: str):
    """Every (precision, spec) setting on every prompt, interleaved prompt by prompt: images, CPU s, full steps."""
    images = {s: [] for s in settings}
    cpu = {s: [] for s in settings}
    full = {s: [] for s in settings}
    counts = _count_full()
    shape = next(iter(pipes.values())).latent_shape_for(1)[1:]
    # warm-up: sessions made and every cut built before any timing
    for prec, spec in settings:
        pipes[prec](scenes[0].caption, steps=2, sampler=sampler, guidance=guidance, cache=spec)
    for i, sc in enumerate(scenes):
        lat = item_latents(shape, [i])
        for s in settings:
            before = len(counts)
            t0 = time.process_time()
            r = pipes[s[0]](sc.caption, steps=steps, sampler=sampler, guidance=guidance, latents=lat, seed=i,
                            cache=s[1])
            cpu[s].append(time.process_time() - t0)
            images[s].append(r.images[0])
            full[s].append(counts[-1] if len(counts) > before else steps)
        if i % 8 == 7:
            log(f"{name}: {i + 1}/{len(scenes)} prompts")
    return images, cpu, full


def _compare(imgs, ref_imgs, cpu, ref_cpu, acc: float, ref_acc: float, suffix: str = "") -> dict:
    ps = [psnr(a[None], b[None]) for a, b in zip(imgs, ref_imgs)]
    finite = [p for p in ps if np.isfinite(p)]
    ratios = [b / c for b, c in zip(ref_cpu, cpu)]
    return {f"speedup_median{suffix}": float(np.median(ratios)), f"speedup_total{suffix}": float(sum(ref_cpu) / sum(cpu)),
            f"psnr_mean{suffix}": float(np.mean(finite)) if finite else float("inf"),
            f"psnr_worst{suffix}": float(min(ps)), f"identical{suffix}": int(sum(not np.isfinite(p) for p in ps)),
            f"strict_points_vs_uncached{suffix}": float(100 * (acc - ref_acc))}


def _label(prec: str, spec: str | None, int8_run: bool = False) -> str:
    if prec == "fp32":
        return spec or ("fp32 uncached" if int8_run else "uncached")
    return f"int8-static + {spec}" if spec else "int8-static uncached"


def run_model(name: str, count: int, only: list[str] | None = None, int8_work: Path | None = None) -> dict:
    folder, sampler, steps, guidance, specs = MODELS[name]
    # magcache needs the folder's calibrated ratios: only on request (--specs), with --int8 (calibrated there)
    specs = [s for s in (only or specs) if s.split(":")[0] in {x.split(":")[0] for x in specs} | {"magcache"}]
    pipes = {"fp32": Pipeline.from_folder(ROOT / folder, threads=1)}
    settings = [("fp32", None)]
    if int8_work is not None:
        q = int8_folder(folder, int8_work)
        if any(s.startswith("magcache") for s in specs):
            calibrated(q, sampler, steps, guidance)
        pipes["int8"] = Pipeline.from_folder(q, threads=1)
        settings += [("int8", None), *(("int8", s) for s in specs)]
    else:
        settings += [("fp32", s) for s in specs]
    scenes = heldout_scenes(EvaluateOptions(count=count))
    images, cpu, full = _generate_all(pipes, settings, scenes, sampler, steps, guidance, name)
    judge = Judge.from_file(threads=1)
    imgs = {s: np.stack(images[s]) for s in settings}
    acc = {s: float(evaluate_images(imgs[s], scenes, judge)["strict_accuracy"]) for s in settings}
    fp32_ref = ("fp32", None)
    rows = []
    for s in settings:
        ref = (s[0], None)  # the same precision uncached: what the cache changes
        row = {"setting": _label(*s, int8_work is not None), "precision": s[0], "cache": s[1], "cpu_s_per_image": float(np.median(cpu[s])),
               "strict_accuracy": acc[s], "full_steps_mean": float(np.mean(full[s])),
               **_compare(imgs[s], imgs[ref], cpu[s], cpu[ref], acc[s], acc[ref])}
        if s[0] != "fp32":
            row.update(_compare(imgs[s], imgs[fp32_ref], cpu[s], cpu[fp32_ref], acc[s], acc[fp32_ref], "_vs_fp32"))
        rows.append(row)
        log(f"{name} {row['setting']}: {row['speedup_median']:.2f}x, {row['psnr_mean']:.1f} dB mean, "
            f"strict {acc[s]:.3f}")
    need = GATE_SPEEDUP_INT8 if int8_work is not None else GATE_SPEEDUP
    gate = [r for r in rows if r["cache"] and r["speedup_median"] >= need and r["psnr_mean"] >= GATE_PSNR
            and abs(r["strict_points_vs_uncached"]) <= GATE_POINTS]
    return {"folder": folder, "int8_folder": None if int8_work is None else f"WORK/{Path(folder).name}-int8-static",
            "sampler": sampler, "steps": steps, "guidance": guidance, "count": count, "rows": rows,
            "gate": {"speedup": need, "psnr": GATE_PSNR, "strict_points": GATE_POINTS,
                     "reference": "int8-static uncached" if int8_work is not None else "fp32 uncached",
                     "passing": [r["setting"] for r in gate]}}


def _row_md(row: dict, int8: bool) -> str:
    cells = [row["setting"], f"{row['speedup_median']:.2f}x", f"{row['speedup_total']:.2f}x", f"{row['full_steps_mean']:.1f}",
             f"{row['psnr_mean']:.1f}", f"{row['psnr_worst']:.1f}", str(row["identical"]),
             f"{row['strict_accuracy']:.3f}", f"{row['strict_points_vs_uncached']:+.1f}"]
    if int8:
        v = (lambda k, f: f.format(row[k]) if k in row else "-")
        cells += [v("speedup_median_vs_fp32", "{:.2f}x"), v("psnr_mean_vs_fp32", "{:.1f}"),
                  v("psnr_worst_vs_fp32", "{:.1f}"), v("strict_points_vs_uncached_vs_fp32", "{:+.1f}")]
    return "| " + " | ".join(cells) + " |"


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# Step caching: speed-up vs quality on the embedded models", "",
             f"CPU: {m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, 1 thread; ONNX Runtime "
             f"{m.get('onnxruntime', '?')}; load average (1 min) before / after: {m['load_before']:.1f} / "
             f"{m.get('load_after', float('nan')):.1f}. Batch 1, held-out prompt-seed pairs, CPU time per image end to "
             "end; speed-up = median of per-prompt uncached/cached ratios (interleaved prompt by prompt).", ""]
    for name, r in results["models"].items():
        int8 = r.get("int8_folder") is not None
        ref = "int8-static uncached" if int8 else "uncached"
        head = ["setting", "speed-up (median)", "speed-up (totals)", "full steps", "PSNR mean", "PSNR worst",
                "identical", "strict acc.", f"points vs {ref}"]
        if int8:
            lines += [f"Columns up to 'points' compare with the same precision uncached (int8 rows: with "
                      f"{r['int8_folder']}, uncached); the last four with fp32 uncached.", ""]
            head += ["speed-up vs fp32", "PSNR vs fp32 mean", "PSNR vs fp32 worst", "points vs fp32"]
        lines += [f"## {name} ({r['folder']}, {r['sampler']} {r['steps']} steps, guidance {r['guidance']}, "
                  f"{r['count']} prompts)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += [_row_md(row, int8) for row in r["rows"]]
        g = r["gate"]
        lines += ["", f"Gate (>= {g['speedup']}x vs {g.get('reference', 'uncached')} at >= {g['psnr']:g} dB mean PSNR, "
                      f"strict accuracy within {g['strict_points']:g} point): "
                      + (", ".join(g["passing"]) or "**no setting passes**"), ""]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(6 * len(results["models"]), 4.2), squeeze=False)
    for ax, (name, r) in zip(axes[0], results["models"].items()):
        for row in r["rows"]:
            spec = row.get("cache", None if row["setting"] == "uncached" else row["setting"])  # older files: no "cache"
            if not spec:
                continue
            method = spec.split(":")[0]
            y = min(row["psnr_mean"], 80.0)
            ax.scatter(row["speedup_median"], y, marker={"first_block": "o", "taylorseer": "s", "deepcache": "^", "residual": "D", "magcache": "v"}[method],
                       c="tab:green" if abs(row["strict_points_vs_uncached"]) <= GATE_POINTS else "tab:red")
            ax.annotate(spec, (row["speedup_median"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(r["gate"]["speedup"], ls="--", c="grey", lw=0.8)
        ax.axhline(GATE_PSNR, ls="--", c="grey", lw=0.8)
        ref = r["gate"].get("reference", "uncached")
        ax.set_xlabel(f"speed-up vs {ref} (CPU time, end to end)")
        ax.set_ylabel(f"mean PSNR vs {ref} (dB)")
        ax.set_title(f"{name}: green = strict accuracy within 1 point")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--specs", nargs="+", default=None, help="cache settings instead of the model's list")
    ap.add_argument("--int8", type=Path, default=None, metavar="WORK",
                    help="run the cache settings on int8-static folders under WORK (quantized there when missing)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache_pareto")
    ap.add_argument("--render", action="store_true", help="only rewrite OUT.md and OUT.png from OUT.json")
    args = ap.parse_args()
    if args.render:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(results))
        plot(results, args.out.with_suffix(".png"))
        return
    results = {"machine": cpu_info(), "models": {}}
    for name in args.models:
        results["models"][name] = run_model(name, args.count, args.specs, args.int8)
    results["machine"]["load_after"] = os.getloadavg()[0]
    write_json(args.out.with_suffix(".json"), results, None)
    md = args.out.with_suffix(".md")
    md.write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))


if __name__ == "__main__":
    main()
