"""Embedded-size backbone latency, 1 thread: fp32 vs quantized folders, interleaved medians at 1/4/16 images.

    python experiments/rotation/dynamic_token_latency.py FP32_FOLDER NAME=FOLDER... [--runs 20]

Used for issue 44's per-token dynamic activations: fp32 vs rotated static W8A8 vs rotated W8A8 with
`-O activations=dynamic-token` (each folder's backbone timed in one process, round-robin, the model's
default size; the backbone sees 2 rows per image).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.folder.artifacts import read_manifest  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import latency  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp32", type=Path)
    ap.add_argument("folders", nargs="+", help="NAME=FOLDER")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    manifest = read_manifest(args.fp32)
    backbone = get_family(manifest.family).backbone
    rel = manifest.components[backbone].path
    files = {"fp32": args.fp32 / rel} | {k: Path(v) / rel for k, v in (f.split("=", 1) for f in args.folders)}
    out = {}
    for images in (1, 4, 16):
        t = latency(files, component_feed(backbone, manifest, batch=images), 1, max(10, args.runs // images))
        base = t["fp32"]["median_ms"]
        out[f"{images} img"] = {k: {"median_ms": round(v["median_ms"], 3), "vs_fp32": round(v["median_ms"] / base, 3)}
                               for k, v in t.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
