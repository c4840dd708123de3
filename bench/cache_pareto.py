"""Step caching's Pareto on both embedded models (issue 25, acceptance 3).

    .venv/bin/python bench/cache_pareto.py [--models sd mmdit] [--count 32] [--rounds 1]

Per model, at its evaluation settings (sd: ddim 20 steps guidance 4; mmdit: flow_euler 20 steps
guidance 3), the held-out prompt-seed pairs are generated at batch 1 on one thread uncached and with
each cache setting (DeepCache for the UNet, first-block cache and TaylorSeer for the MMDiT), the
settings interleaved prompt by prompt so load drift hits all alike.  Reported per setting: the
speed-up vs uncached at equal steps (CPU time per image, end to end: text encoding + sampling +
decoding; the median of per-prompt ratios and the ratio of totals), PSNR vs the uncached image
(mean, worst), the judge's strict accuracy (and its difference to uncached, in points) and how many
of the 20 steps ran the full backbone.  Writes bench/results/cache_pareto.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.artifacts import write_json  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, heldout_scenes, item_latents  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.runtime import cache as cache_mod  # noqa: E402

MODELS = {
    "sd": ("models/shapes-sd-onnx", "ddim", 20, 4.0,
           ["deepcache:2", "deepcache:3", "deepcache:4", "deepcache:5", "deepcache:3:2"]),
    "mmdit": ("models/shapes-mmdit-onnx", "flow_euler", 20, 3.0,
              ["first_block:0.05", "first_block:0.1", "first_block:0.15", "first_block:0.2", "first_block:0.3",
               "first_block:0.4", "taylorseer:2", "taylorseer:3", "taylorseer:2:2", "taylorseer:3:2", "taylorseer:4:2",
               "taylorseer:5:2"]),
}
GATE_SPEEDUP, GATE_PSNR, GATE_POINTS = 1.8, 30.0, 1.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    m = re.search(r"model name\s*:\s*(.+)", text)
    flags = re.search(r"flags\s*:\s*(.+)", text)
    isa = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx", "avx2")))
    return {"cpu": m.group(1).strip() if m else platform.processor(), "isa": isa, "cores": os.cpu_count(),
            "load_before": os.getloadavg()[0]}


def _count_full(pipe):
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


def run_model(name: str, count: int, only: list[str] | None = None) -> dict:
    folder, sampler, steps, guidance, specs = MODELS[name]
    specs = [s for s in (only or specs) if s.split(":")[0] in {x.split(":")[0] for x in specs}]
    pipe = Pipeline.from_folder(ROOT / folder, threads=1)
    scenes = heldout_scenes(EvaluateOptions(count=count))
    shape = pipe.latent_shape_for(1)[1:]
    settings = [None, *specs]
    images = {s: [] for s in settings}
    cpu = {s: [] for s in settings}
    full = {s: [] for s in settings}
    counts = _count_full(pipe)
    # warm-up: sessions made and every cut built before any timing
    for s in settings:
        pipe(scenes[0].caption, steps=2, sampler=sampler, guidance=guidance, cache=s)
    for i, sc in enumerate(scenes):
        lat = item_latents(shape, [i])
        for s in settings:
            before = len(counts)
            t0 = time.process_time()
            r = pipe(sc.caption, steps=steps, sampler=sampler, guidance=guidance, latents=lat, seed=i, cache=s)
            cpu[s].append(time.process_time() - t0)
            images[s].append(r.images[0])
            full[s].append(counts[-1] if len(counts) > before else steps)
        if i % 8 == 7:
            log(f"{name}: {i + 1}/{len(scenes)} prompts")
    judge = Judge.from_file(threads=1)
    base_imgs = np.stack(images[None])
    base_acc = evaluate_images(base_imgs, scenes, judge)["strict_accuracy"]
    rows = []
    for s in settings:
        imgs = np.stack(images[s])
        acc = evaluate_images(imgs, scenes, judge)["strict_accuracy"]
        ps = [psnr(a[None], b[None]) for a, b in zip(imgs, base_imgs)]
        finite = [p for p in ps if np.isfinite(p)]
        ratios = [b / c for b, c in zip(cpu[None], cpu[s])]
        rows.append({
            "setting": s or "uncached", "speedup_median": float(np.median(ratios)),
            "speedup_total": float(sum(cpu[None]) / sum(cpu[s])), "cpu_s_per_image": float(np.median(cpu[s])),
            "psnr_mean": float(np.mean(finite)) if finite else float("inf"),
            "psnr_worst": float(min(ps)), "identical": int(sum(not np.isfinite(p) for p in ps)),
            "strict_accuracy": float(acc), "strict_points_vs_uncached": float(100 * (acc - base_acc)),
            "full_steps_mean": float(np.mean(full[s])),
        })
        log(f"{name} {rows[-1]['setting']}: {rows[-1]['speedup_median']:.2f}x, {rows[-1]['psnr_mean']:.1f} dB mean, "
            f"strict {acc:.3f}")
    gate = [r for r in rows[1:] if r["speedup_median"] >= GATE_SPEEDUP and r["psnr_mean"] >= GATE_PSNR
            and abs(r["strict_points_vs_uncached"]) <= GATE_POINTS]
    return {"folder": folder, "sampler": sampler, "steps": steps, "guidance": guidance, "count": count, "rows": rows,
            "gate": {"speedup": GATE_SPEEDUP, "psnr": GATE_PSNR, "strict_points": GATE_POINTS,
                     "passing": [r["setting"] for r in gate]}}


def markdown(results: dict) -> str:
    lines = ["# Step caching: speed-up vs quality on the embedded models", "",
             f"CPU: {results['machine']['cpu']} ({', '.join(results['machine']['isa'])}), "
             f"{results['machine']['cores']} cores, 1 thread; load average before: "
             f"{results['machine']['load_before']:.1f}. Batch 1, held-out prompt-seed pairs, CPU time per image end to "
             "end; speed-up = median of per-prompt uncached/cached ratios (interleaved prompt by prompt).", ""]
    for name, r in results["models"].items():
        lines += [f"## {name} ({r['folder']}, {r['sampler']} {r['steps']} steps, guidance {r['guidance']}, "
                  f"{r['count']} prompts)", "",
                  "| setting | speed-up (median) | speed-up (totals) | full steps | PSNR mean | PSNR worst | identical | "
                  "strict acc. | points vs uncached |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['setting']} | {row['speedup_median']:.2f}x | {row['speedup_total']:.2f}x | "
                         f"{row['full_steps_mean']:.1f} | {row['psnr_mean']:.1f} | {row['psnr_worst']:.1f} | "
                         f"{row['identical']} | {row['strict_accuracy']:.3f} | {row['strict_points_vs_uncached']:+.1f} |")
        g = r["gate"]
        lines += ["", f"Gate (>= {g['speedup']}x at >= {g['psnr']:g} dB mean PSNR, strict accuracy within "
                      f"{g['strict_points']:g} point): " + (", ".join(g["passing"]) or "**no setting passes**"), ""]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(6 * len(results["models"]), 4.2), squeeze=False)
    for ax, (name, r) in zip(axes[0], results["models"].items()):
        for row in r["rows"][1:]:
            method = row["setting"].split(":")[0]
            y = min(row["psnr_mean"], 80.0)
            ax.scatter(row["speedup_median"], y, marker={"first_block": "o", "taylorseer": "s", "deepcache": "^"}[method],
                       c="tab:green" if abs(row["strict_points_vs_uncached"]) <= GATE_POINTS else "tab:red")
            ax.annotate(row["setting"], (row["speedup_median"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(GATE_SPEEDUP, ls="--", c="grey", lw=0.8)
        ax.axhline(GATE_PSNR, ls="--", c="grey", lw=0.8)
        ax.set_xlabel("speed-up vs uncached (CPU time, end to end)")
        ax.set_ylabel("mean PSNR vs uncached (dB)")
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
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache_pareto")
    args = ap.parse_args()
    results = {"machine": cpu_info(), "models": {}}
    for name in args.models:
        results["models"][name] = run_model(name, args.count, args.specs)
    results["machine"]["load_after"] = os.getloadavg()[0]
    write_json(args.out.with_suffix(".json"), results, None)
    md = args.out.with_suffix(".md")
    md.write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))


if __name__ == "__main__":
    main()
