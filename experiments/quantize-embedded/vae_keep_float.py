#!/usr/bin/env python
"""Which VAE-decoder layers to keep float: the int8-static decoder with each candidate set kept float,
final-image PSNR vs the fp32 decoder on held-out pairs (the fp32 final latents of the held-out prompts,
seed i for prompt i, decoded by both), on a trained embedded model (issue 16).

    python experiments/quantize-embedded/vae_keep_float.py --model models/shapes-sd-onnx --count 64 --out bench/report_sd15/vae_keep_float.json

Calibration as `quantize -O components=...,vae_decoder` does it: the final latents of 32 calib-split
prompts (seeds 10000+), the model's recommended sampler settings, guidance with the empty negative prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from onnxdiffusion.folder.artifacts import component_path, read_manifest  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig  # noqa: E402
from onnxdiffusion.quantize.calibration import capture, load_prompts  # noqa: E402
from onnxdiffusion.quantize.components import calibration_feeds, quantize_component  # noqa: E402
from onnxdiffusion.quantize.runner import session  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

CANDIDATES = {
    "none (every conv int8)": (),
    "conv_out": ("*conv_out*",),
    "conv_in": ("*conv_in*",),
    "conv_in + conv_out": ("*conv_in*", "*conv_out*"),
    "last up block + conv_out": ("*up_blocks.3*", "*conv_out*"),
    "mid block (attention) + conv_out": ("*mid_block*", "*conv_out*"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/shapes-sd-onnx"))
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    manifest = read_manifest(args.model)
    rec = manifest.get("recommended") or {}
    pipe = Pipeline.from_folder(args.model, threads=1)
    cal = CalibrationConfig(count=32, sampler=rec.get("sampler", "ddim"), steps=rec.get("steps", 20), guidance=rec.get("guidance", 4.0))
    prompts, _ = load_prompts(cal)
    feeds = calibration_feeds(pipe, "vae_decoder", capture(pipe, prompts, cal), prompts)
    ev = EvaluateOptions(count=args.count, steps=cal.steps, sampler=rec.get("sampler"), guidance=cal.guidance, batch=16)
    latents = []
    ref = generate_set(pipe, heldout_scenes(ev), ev, progress=False,
                       step_callback=lambda s, e: latents.append(e.latents) if hasattr(e, "images") else None)
    fp32 = onnx.load(str(component_path(args.model, manifest, "vae_decoder")))
    rows = {}
    for label, keep in CANDIDATES.items():
        q, details = quantize_component(fp32, feeds, keep, 1)
        pipe.vae_decoder = session(q, 1)
        got = np.concatenate([pipe.decode(x) for x in latents])
        vals = [psnr(a, b) for a, b in zip(ref, got)]
        rows[label] = {"keep_float": list(keep), "float_convs": len(details["float_nodes"]), "mean_db": round(float(np.mean(vals)), 2),
                       "worst_db": round(float(min(vals)), 2), "calibration_output_snr_db": details["output_snr_db"],
                       "int8_bytes": len(q.SerializeToString())}
        print(label, rows[label], file=sys.stderr, flush=True)
        args.out.write_text(json.dumps({"model": str(args.model), "count": args.count, "calibration": cal.to_dict(),
                                        "fp32_bytes": fp32.ByteSize(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
