"""A quick proxy for choosing int4-weights' algorithm / block size / symmetry (issue 12, acceptance 3).

    nice -n 10 .venv/bin/python experiments/quantize-embedded/int4_algorithms.py --models models/shapes-mmdit-onnx models/shapes-sd-onnx

Each variant quantizes the backbone (no quality measurement, no calibration unless target_ratio),
generates the first --count held-out prompt-seed pairs at the model's recommended settings and
reports image PSNR vs fp32 (mean, worst), backbone size ratio and quantize seconds. The full
128-pair evaluation of the winner is experiments/quantize-embedded/quantize_eval.py's issue12 suite. Writes OUT (.json + .md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantize_eval import generate, model_settings  # noqa: E402

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402

VARIANTS = [  # (label, options)
    ("default sym b32", {}),
    ("default asym b32", {"symmetric": "false"}),
    ("default sym b128", {"block_size": "128"}),
    ("default asym b128", {"block_size": "128", "symmetric": "false"}),
    ("default sym b16", {"block_size": "16"}),
    ("hqq b32", {"algorithm": "hqq"}),
    ("hqq b128", {"algorithm": "hqq", "block_size": "128"}),
    ("hqq b16", {"algorithm": "hqq", "block_size": "16"}),
    ("hqq b64", {"algorithm": "hqq", "block_size": "64"}),
    ("gptq b32", {"algorithm": "gptq"}),
    ("gptq b16", {"algorithm": "gptq", "block_size": "16"}),
    ("default asym b64", {"block_size": "64", "symmetric": "false"}),
    ("default asym b16", {"block_size": "16", "symmetric": "false"}),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[str(ROOT / "models" / "shapes-mmdit-onnx")])
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--extra", default="", help="options added to every variant, k=v,k=v (e.g. target_ratio=3.5)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "int4_algorithms")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "int4_algorithms.json")
    args = ap.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in args.extra.split(",") if kv)
    result = json.loads(args.out.read_text()) if args.out.exists() else {"count": args.count, "models": {}}
    for spec in args.models:
        folder, s = model_settings(spec)
        options = EvaluateOptions(count=args.count, steps=s["steps"], sampler=s["sampler"], guidance=s["guidance"], batch=16)
        scenes = heldout_scenes(options)
        ref = generate(folder, scenes, options)
        calib = CalibrationConfig(count=32, steps=s["steps"], sampler=s["sampler"], guidance=s["guidance"])
        rows = result["models"].setdefault(folder.name, {})
        for label, opts in VARIANTS:
            if args.only and label not in args.only:
                continue
            opts = {**opts, **extra}
            label = label + (" " + ",".join(f"{k}={v}" for k, v in extra.items()) if extra else "")
            out = args.work / folder.name / label.replace(" ", "_").replace(",", "_").replace("=", "")
            out.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            report = quantize(folder, out, QuantizeConfig(recipe=recipe_class("int4-weights").with_options(opts),
                                                          calibration=calib, threads=1, latency_runs=3),
                              overwrite=True, measure_quality=False)
            seconds = time.perf_counter() - t0
            images = generate(out, scenes, options)
            per = [psnr(a, b) for a, b in zip(images, ref)]
            size = report["sizes"].get("unet", {})
            rows[label] = {"options": opts, "psnr_db_mean": round(float(np.mean(per)), 2),
                           "psnr_db_min": round(float(np.min(per)), 2), "size_ratio": size.get("ratio"),
                           "quantize_seconds": round(seconds, 1)}
            print(folder.name, label, rows[label], flush=True)
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(args.out)
    lines = [f"## int4-weights variants, quick proxy ({result['count']} held-out pairs, images vs fp32)", "",
             "| model | variant | PSNR mean (dB) | worst (dB) | backbone smaller | quantize s |", "|---|---|---|---|---|---|"]
    for m, rows in result["models"].items():
        for label, r in rows.items():
            lines.append(f"| {m} | {label} | {r['psnr_db_mean']:.2f} | {r['psnr_db_min']:.2f} | {r['size_ratio']}x | {r['quantize_seconds']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
