"""Run-time LoRA on the embedded shapes-sd model (issue 23, acceptance 2): the int8-static backbone with a
rank-16 adapter against fp32 + the same adapter over held-out prompts, the backbone step time with and
without an adapter (1 thread, CPU time, interleaved rounds, medians; merged weights and, in the same rounds,
the insertion points' branches), and what changing the adapter set costs.

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
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "models" / "training")]


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
    """CPU seconds per backbone call (guided batch), medians over interleaved rounds. `points` variants run as
    the pipeline runs them (no adapter: the plain graph; an adapter: merged weights, adapters/fused.py);
    `branches` variants run the points graph itself with the A/B feeds bound (the run-time path before the
    merged weights), in the same rounds."""
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.runtime.loading import backbone_session

    pipes = {k: Pipeline.from_folder(paths[k], threads=1) for k in ("fp32", "fp32_points", "int8", "int8_points")}
    lora = [(paths["lora"], 1.0)]
    variants = {}
    for kind in ("fp32", "int8"):
        key = kind + "_points"
        info = pipes[key].manifest["components"]["unet"]
        points_graph = backbone_session(paths[key] / info["path"], info, "cpu", 1)
        variants.update({kind: (kind, None, None), f"{kind} points, no adapter": (key, None, None),
                         f"{kind} points + rank-16": (key, lora, None),
                         f"{kind} branches, no adapter": (key, None, points_graph),
                         f"{kind} branches + rank-16": (key, lora, points_graph)})
    fns = {}
    for name, (key, loras, session) in variants.items():
        pipe = pipes[key]
        adapter = pipe.lora_feeds(loras)
        shape = pipe.latent_shape_for(1)
        fns[name] = pipe.guided_backbone(["a red circle"], None, 4.0, 64, 64, shape, session=session, adapter=adapter)
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


def switch_costs(paths: dict, repeats: int = 10) -> dict:
    """What changing the adapter set costs on a pipeline whose fused session exists (files already parsed):
    the set's A/B feeds plus its merged weights, CPU ms, median over `repeats`; and the one-time making of the
    fused session (first adapter on a pipeline), with the layers merged and kept as branches."""
    from onnxdiffusion.runtime import Pipeline

    out = {}
    for key in ("fp32_points", "int8_points"):
        pipe = Pipeline.from_folder(paths[key], threads=1)
        t = time.process_time()
        pipe.lora.fused.fused()
        first = time.process_time() - t
        lora = [(paths["lora"], 1.0)]
        pipe.lora.fused.feeds(pipe.lora_feeds(lora))  # the file read once (LoraCache)
        times = []
        for _ in range(repeats):
            t = time.process_time()
            pipe.lora.fused.feeds(pipe.lora_feeds(lora))
            times.append(time.process_time() - t)
        targets = pipe.manifest["components"]["unet"]["lora"]["targets"]
        out[key] = {"switch_ms": statistics.median(times) * 1e3, "fused_session_ms": first * 1e3,
                    "merged_layers": len(pipe.lora.fused.layers),
                    "branch_layers": len(targets) - len(pipe.lora.fused.layers)}
    return out


def summarize(samples: dict[str, list[float]]) -> tuple[dict, dict]:
    """Median seconds per variant, and per ratio the median of the per-round ratios (each round's variants ran
    back to back, so a shared machine's load drifts out of the ratio)."""
    times = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {}
    for k, v in samples.items():
        kind = "int8" if k.startswith("int8") else "fp32"
        for ref in (kind, f"{kind} points, no adapter", f"{kind} branches, no adapter"):
            if k != ref and (ref == kind or ref.split()[1] == (k.split() + [''])[1].rstrip(',') + ','):
                ratios[f"{k} / {ref}"] = statistics.median(a / b for a, b in zip(v, samples[ref]))
    return times, ratios


def quality(paths: dict, count: int) -> dict:
    from onnxdiffusion.evaluate import scenes
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
    switch = switch_costs(paths)
    q = quality(paths, args.prompts) if args.prompts else {"prompts": 0, "rows": []}
    load = Path("/proc/loadavg").read_text().split()[:3]
    result = {"cpu": cpu(), "load_avg": load, "load_avg_before": load_before, "python": platform.python_version(),
              "threads": 1, "step_seconds": times, "ratios": ratios, "switch": switch, "step_samples": samples,
              "quality": {k: v for k, v in q.items() if k != "rows"}, "rows": q["rows"]}
    (HERE / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Run-time LoRA on the embedded shapes-sd model", "",
             f"CPU: {result['cpu']}; load {' '.join(load_before)} before, {' '.join(load)} after (a shared machine); "
             f"1 thread; CPU time per guided backbone call, median of {args.rounds} interleaved rounds x {args.calls}; "
             "ratios: median of the per-round ratios.", "",
             f"`PYTHONPATH=src python experiments/lora/measure.py WORK --rounds {args.rounds} --calls {args.calls} "
             f"--prompts {args.prompts} --out {args.out}`", "",
             "`points`: the folder with insertion points as the pipeline runs it (no adapter: the plain graph, the "
             "branches taken out; an adapter: its merged weights, adapters/fused.py); `branches`: the points graph "
             "itself with the adapter's A/B bound (the run-time path before merged weights), same rounds.", "",
             "| variant | ms / call | vs plain folder | vs same graph, no adapter |", "|---|---|---|---|"]
    for k, v in times.items():
        kind = "int8" if k.startswith("int8") else "fp32"
        plain = ratios.get(f"{k} / {kind}")
        same = next((r for key, r in ratios.items() if key.startswith(f"{k} / ") and key.endswith("no adapter")), None)
        same_cell = f"{same:.3f}x" if same else ("1.000x" if k.endswith("no adapter") else "")
        lines.append(f"| {k} | {v * 1e3:.2f} | {f'{plain:.3f}x' if plain else '1.000x'} | {same_cell} |")
    lines += ["", "Changing the adapter set (`points` pipelines; CPU ms, median of 10; the file already parsed):", "",
              "| folder | merged layers | layers kept as branches | switch: A/B + merged weights | first adapter: "
              "fused session made |", "|---|---|---|---|---|"]
    for key, sw in switch.items():
        lines.append(f"| {key} | {sw['merged_layers']} | {sw['branch_layers']} | {sw['switch_ms']:.1f} ms | "
                     f"{sw['fused_session_ms']:.0f} ms |")
    if q["rows"]:
        lines += ["", f"Quality over {q['prompts']} held-out prompts (PSNR, dB, uint8 images, 20 DDIM steps):", "",
                  "| comparison | mean | worst |", "|---|---|---|"]
        for k in ("int8+lora_vs_fp32+lora", "int8_vs_fp32", "lora_effect_fp32"):
            lines.append(f"| {k} | {q['mean ' + k]:.2f} | {q['worst ' + k]:.2f} |")
    (HERE / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
