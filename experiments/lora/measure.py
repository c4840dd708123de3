"""Run-time LoRA on the embedded shapes-sd model (issue 23, acceptance 2): the int8-static backbone with a
rank-16 adapter against fp32 + the same adapter over held-out prompts, and the backbone step time with and
without an adapter (1 thread, CPU time, interleaved rounds, medians).

    PYTHONPATH=src python experiments/lora/measure.py WORK [--prompts 32] [--rounds 5] [--calls 10] [--out results]

WORK holds the derived folders (fp32 and int8 with insertion points, the LoRA); results.{md,json} land here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "models" / "training")]


def cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("Flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{model} ({' '.join(isa)})"


def prepare(work: Path, calib: int) -> dict[str, Path]:
    from lora_helpers import make_lora

    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class

    src, onnx = ROOT / "models" / "shapes-sd", ROOT / "models" / "shapes-sd-onnx"
    paths = {"fp32": onnx, "fp32_points": work / "fp32_points", "int8": work / "int8", "int8_points": work / "int8_points"}
    if not paths["int8"].exists():
        quantize(onnx, paths["int8"], QuantizeConfig(recipe=recipe_class("int8-static")(),
                                                     calibration=CalibrationConfig(count=calib), latency_runs=1,
                                                     measure_memory=False))
    for base in ("fp32", "int8"):
        if not paths[base + "_points"].exists():
            add_points(paths[base], paths[base + "_points"])
    lora = work / "lora16" / "pytorch_lora_weights.safetensors"
    if not lora.exists():
        make_lora(src, work / "lora16", seed=16, rank=16, std=0.05)
    paths["lora"] = lora
    return paths


def step_times(paths: dict, rounds: int, calls: int) -> dict:
    """CPU seconds per backbone call (guided batch), medians over interleaved rounds."""
    from onnxdiffusion.runtime import Pipeline

    pipes = {k: Pipeline.from_folder(paths[k], threads=1) for k in ("fp32", "fp32_points", "int8", "int8_points")}
    variants = {"fp32": ("fp32", None), "fp32 points, no adapter": ("fp32_points", None),
                "fp32 points + rank-16": ("fp32_points", [(paths["lora"], 1.0)]),
                "int8": ("int8", None), "int8 points, no adapter": ("int8_points", None),
                "int8 points + rank-16": ("int8_points", [(paths["lora"], 1.0)])}
    fns = {}
    for name, (key, loras) in variants.items():
        pipe = pipes[key]
        adapter = pipe.lora_feeds(loras)
        shape = pipe.latent_shape_for(1)
        fns[name] = pipe.guided_backbone(["a red circle"], None, 4.0, 64, 64, shape, adapter=adapter)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    for fn in fns.values():
        fn(x, 500.0)  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.process_time()
            for _ in range(calls):
                fn(x, 500.0)
            samples[name].append((time.process_time() - t) / calls)
    return samples


def summarize(samples: dict[str, list[float]]) -> tuple[dict, dict]:
    """Median seconds per variant, and per ratio the median of the per-round ratios (each round's variants ran
    back to back, so a shared machine's load drifts out of the ratio)."""
    times = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {}
    for k, v in samples.items():
        kind = "int8" if k.startswith("int8") else "fp32"
        for ref in (kind, f"{kind} points, no adapter"):
            if k != ref and (ref == kind or "points" in k):
                ratios[f"{k} / {ref}"] = statistics.median(a / b for a, b in zip(v, samples[ref]))
    return times, ratios


def quality(paths: dict, count: int) -> dict:
    from onnxdiffusion import scenes
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    pipes = {k: Pipeline.from_folder(paths[k]) for k in ("fp32_points", "int8_points")}
    lora = [(paths["lora"], 1.0)]
    rows = []
    for i, scene in enumerate(scenes.scenes("heldout", count)):
        kw = dict(seed=1000 + i)
        f_l, q_l = (pipes[k](scene.caption, loras=lora, **kw).images for k in ("fp32_points", "int8_points"))
        f, q = (pipes[k](scene.caption, **kw).images for k in ("fp32_points", "int8_points"))
        rows.append({"prompt": scene.caption, "int8+lora_vs_fp32+lora": psnr(q_l, f_l), "int8_vs_fp32": psnr(q, f),
                     "lora_effect_fp32": psnr(f_l, f)})
    keys = [k for k in rows[0] if k != "prompt"]
    return {"prompts": count, **{f"mean {k}": float(np.mean([r[k] for r in rows])) for k in keys},
            **{f"worst {k}": float(np.min([r[k] for r in rows])) for k in keys}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--out", default="results", help="results file name (without .md/.json) in experiments/lora/")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    paths = prepare(args.work, args.calib)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    samples = step_times(paths, args.rounds, args.calls)
    times, ratios = summarize(samples)
    q = quality(paths, args.prompts) if args.prompts else {"prompts": 0, "rows": []}
    load = Path("/proc/loadavg").read_text().split()[:3]
    result = {"cpu": cpu(), "load_avg": load, "load_avg_before": load_before, "python": platform.python_version(),
              "threads": 1, "step_seconds": times, "ratios": ratios, "step_samples": samples,
              "quality": {k: v for k, v in q.items() if k != "rows"}, "rows": q["rows"]}
    (HERE / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Run-time LoRA on the embedded shapes-sd model", "",
             f"CPU: {result['cpu']}; load {' '.join(load_before)} before, {' '.join(load)} after (a shared machine); "
             f"1 thread; CPU time per guided backbone call, median of {args.rounds} interleaved rounds x {args.calls}; "
             "ratios: median of the per-round ratios.", "",
             f"`PYTHONPATH=src python experiments/lora/measure.py WORK --rounds {args.rounds} --calls {args.calls} "
             f"--prompts {args.prompts} --out {args.out}`", "",
             "| variant | ms / call | vs plain folder | vs points, no adapter |", "|---|---|---|---|"]
    for k, v in times.items():
        kind = "int8" if k.startswith("int8") else "fp32"
        plain, points = ratios.get(f"{k} / {kind}"), ratios.get(f"{k} / {kind} points, no adapter")
        points_cell = f"{points:.3f}x" if points else ("1.000x" if k.endswith("points, no adapter") else "")
        lines.append(f"| {k} | {v * 1e3:.2f} | {f'{plain:.3f}x' if plain else '1.000x'} | {points_cell} |")
    if q["rows"]:
        lines += ["", f"Quality over {q['prompts']} held-out prompts (PSNR, dB, uint8 images, 20 DDIM steps):", "",
                  "| comparison | mean | worst |", "|---|---|---|"]
        for k in ("int8+lora_vs_fp32+lora", "int8_vs_fp32", "lora_effect_fp32"):
            lines.append(f"| {k} | {q['mean ' + k]:.2f} | {q['worst ' + k]:.2f} |")
    (HERE / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
