"""Room in the tree: shapes-sd-onnx re-exported from its own float16 diffusers folder, stored float16.

The committed ONNX copy had been exported from the float32 training weights before models/shapes-sd was
cast to float16, so it was not reproducible from the tree and held 29 MB of float32 that float16 storage
could not shrink. Re-exported from models/shapes-sd (`make model-export`, then the tiny decoder and
`relayout --storage fp16`) every weight is a float16 value: 15 MB, the VAE byte for byte the MMDiT's.
This script says what the weight rounding did to the pictures: the judge on the held-out prompts
(as models/shapes-sd/eval.json) for both folders, and each new image's PSNR against the old one.

    PYTHONPATH=src python experiments/room/sd_fp16_reexport.py OLD_FOLDER NEW_FOLDER [--count 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_model  # noqa: E402

HERE = Path(__file__).resolve().parent
KEYS = ("attribute_accuracy", "strict_accuracy", "position_accuracy", "shape_accuracy", "colour_accuracy",
        "size_accuracy", "frechet_distance")


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--count", type=int, default=256)
    args = ap.parse_args()
    runs = {}
    for name, folder in (("old", args.old), ("new", args.new)):
        for decoder in ("full", "tiny"):
            r = evaluate_model(str(folder), EvaluateOptions(count=args.count, decoder=decoder), progress=False)
            runs[(name, decoder)] = r
            print(name, decoder, {k: round(r[k], 4) for k in KEYS})
    result = {"cpu": cpu(), "count": args.count, "steps": 20, "sampler": "ddim", "guidance": 4.0,
              "bytes": {"old": folder_bytes(args.old), "new": folder_bytes(args.new)}, "runs": {}}
    for decoder in ("full", "tiny"):
        old, new = runs[("old", decoder)], runs[("new", decoder)]
        p = np.array([psnr(a, b) for a, b in zip(old["_images"], new["_images"])])
        result["runs"][decoder] = {
            "old": {k: old[k] for k in KEYS}, "new": {k: new[k] for k in KEYS},
            "psnr_new_vs_old": {"mean": float(np.mean(p)), "median": float(np.median(p)), "min": float(p.min())},
        }
    (HERE / "sd_fp16_reexport.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# shapes-sd-onnx: float32 export vs float16 re-export ({args.count} held-out prompts)", "",
             f"CPU: {result['cpu']}. DDIM 20 steps, guidance 4, seeds as `onnxdiffusion evaluate`. Folder "
             f"{result['bytes']['old'] / 1e6:.1f} MB -> {result['bytes']['new'] / 1e6:.1f} MB.", "",
             "| decoder | folder | attribute | strict | position | shape | colour | size | FD | PSNR vs old (mean / min) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for decoder, r in result["runs"].items():
        for name in ("old", "new"):
            m = r[name]
            ps = f"{r['psnr_new_vs_old']['mean']:.1f} / {r['psnr_new_vs_old']['min']:.1f} dB" if name == "new" else ""
            lines.append(f"| {decoder} | {name} | {m['attribute_accuracy']:.3f} | {m['strict_accuracy']:.3f} | "
                         f"{m['position_accuracy']:.3f} | {m['shape_accuracy']:.3f} | {m['colour_accuracy']:.3f} | "
                         f"{m['size_accuracy']:.3f} | {m['frechet_distance']:.1f} | {ps} |")
    lines += ["", "    PYTHONPATH=src python experiments/room/sd_fp16_reexport.py OLD NEW --count " f"{args.count}", ""]
    (HERE / "sd_fp16_reexport.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
