#!/usr/bin/env python
"""int8-static with -O kernels=auto (convs laid out for this CPU) vs today's (kernels=portable), embedded models.

For each embedded model: quantize twice (same calibration), generate the held-out prompts with fp32 and both
int8 folders (same seeds), report mean image PSNR vs fp32, whether the two int8 image sets are identical, the
lowering the manifest records, and the backbone call's CPU time (1 thread, interleaved rounds, medians).

    python experiments/amx/embedded_quality.py --work /tmp/amx-quality --count 32 --out experiments/amx/results/embedded.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.bench.machine import machine_facts  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

MODELS = {"shapes-sd": ROOT / "models" / "shapes-sd-onnx", "shapes-mmdit": ROOT / "models" / "shapes-mmdit-onnx"}


def backbone_times(folders: dict[str, Path], rounds: int = 5, calls: int = 5) -> dict[str, float]:
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.families import get_family
    from onnxdiffusion.quantize.report import component_feed

    pipes = {k: Pipeline.from_folder(f, threads=1) for k, f in folders.items()}
    man = read_manifest(next(iter(folders.values())))
    feed = component_feed(get_family(man.get("family")).backbone, man)
    cpu: dict[str, list[float]] = {k: [] for k in pipes}
    for k, p in pipes.items():
        p.backbone.run(None, feed)
    for r in range(rounds):
        for k in list(pipes)[r % len(pipes):] + list(pipes)[: r % len(pipes)]:
            c = time.process_time()
            for _ in range(calls):
                pipes[k].backbone.run(None, feed)
            cpu[k].append((time.process_time() - c) / calls)
    return {k: statistics.median(v) for k, v in cpu.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {"machine": machine_facts(), "count": args.count, "models": {}}
    if args.out.exists():  # a rerun for some models keeps the others' rows
        res["models"] = json.loads(args.out.read_text()).get("models", {})
    for name in args.models:
        src = MODELS[name]
        rec = json.loads((src / "manifest.json").read_text()).get("recommended") or {}
        sampler, steps, guidance = rec.get("sampler", "ddim"), rec.get("steps", 20), rec.get("guidance", 4.0)
        folders = {"fp32": src}
        for kernels in ("portable", "auto"):
            out = args.work / f"{name}-{kernels}"
            if not (out / "manifest.json").exists():
                print(f"{name}: quantize kernels={kernels}", flush=True)
                cal = CalibrationConfig(sampler=sampler, steps=steps, guidance=guidance)  # the CLI's defaults
                quantize(src, out, QuantizeConfig(recipe=Int8StaticRecipe(kernels=kernels), calibration=cal), overwrite=True,
                         measure_quality=False, log=lambda m: None)
            folders[f"int8-{kernels}"] = out
        opts = EvaluateOptions(count=args.count, batch=8, sampler=sampler, steps=steps, guidance=guidance)
        scenes = heldout_scenes(opts)
        images = {}
        for k, f in folders.items():
            print(f"{name}: generate {k}", flush=True)
            pipe = Pipeline.from_folder(f, threads=1)
            images[k] = generate_set(pipe, scenes, opts, progress=False)
        rec = json.loads((folders["int8-auto"] / "manifest.json").read_text())
        lowering = next(iter(c.get("int8_kernels") for c in rec["components"].values() if c.get("int8_kernels")), None)
        row = {"lowering": lowering, "sampler": sampler, "steps": opts.steps, "guidance": opts.guidance}
        for k in ("int8-portable", "int8-auto"):
            vals = [psnr(a, b) for a, b in zip(images["fp32"], images[k])]
            row[f"{k}_psnr_mean_db"] = float(np.mean([min(v, 100.0) for v in vals]))
            row[f"{k}_psnr_min_db"] = float(min(vals))
        row["delta_db"] = row["int8-auto_psnr_mean_db"] - row["int8-portable_psnr_mean_db"]
        row["int8_images_identical"] = bool(np.array_equal(images["int8-portable"], images["int8-auto"]))
        print(f"{name}: timing backbones", flush=True)
        row["backbone_cpu_s"] = backbone_times(folders)
        res["models"][name] = row
        print(json.dumps(row, indent=1), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
