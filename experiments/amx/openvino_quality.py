#!/usr/bin/env python
"""Embedded-model quality of the OpenVINO-provider profiles against ORT's CPU path.

`images` makes one image set (held-out prompts, the folder's recommended sampler/steps/guidance, scene i with
seed i, batch 1 so every variant sees the same shapes) with a folder and an optional profile, into a .npy;
run it with the interpreter that has the provider (onnxruntime-openvino) for profile rows. `table` prints mean
PSNR of each set against the fp32 set and writes JSON:

    python experiments/amx/openvino_quality.py images models/shapes-sd-onnx - sd/fp32.npy --count 16
    OVPY experiments/amx/openvino_quality.py images SD_QDQ openvino-int8 sd/ov-bf16-static.npy --count 16
    python experiments/amx/openvino_quality.py table sd/fp32.npy sd/*.npy --out results/openvino_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def images(folder: str, profile: str, out: Path, count: int) -> None:
    from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(folder, threads=1, profile=None if profile == "-" else profile)
    rec = pipe.recommended
    opts = EvaluateOptions(count=count, steps=rec.get("steps", 20), sampler=rec.get("sampler"),
                           guidance=rec.get("guidance", 4.0), batch=1)
    t = time.process_time()
    imgs = generate_set(pipe, heldout_scenes(opts), opts, progress=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, imgs)
    print(json.dumps({"out": out.name, "cpu_s": round(time.process_time() - t, 2), "profile": profile}))


def table(reference: Path, sets: list[Path], out: Path | None) -> None:
    from onnxdiffusion.bench.machine import machine_facts
    from onnxdiffusion.evaluate.metrics import psnr

    ref = np.load(reference)
    rows = {}
    for s in sets:
        if s == reference:
            continue
        imgs = np.load(s)
        vals = [psnr(a, b) for a, b in zip(ref, imgs)]
        rows[s.stem] = {"psnr_mean_db": float(np.mean(vals)), "psnr_min_db": float(np.min(vals)), "count": len(vals)}
        print(f"{s.stem:32s} {rows[s.stem]['psnr_mean_db']:7.2f} dB (min {rows[s.stem]['psnr_min_db']:.2f})")
    if out:
        out.write_text(json.dumps({"machine": machine_facts(), "reference": reference.stem, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("images")
    a.add_argument("folder")
    a.add_argument("profile", help="a profile name or YAML, or - for ORT's CPU provider")
    a.add_argument("out", type=Path)
    a.add_argument("--count", type=int, default=16)
    b = sub.add_parser("table")
    b.add_argument("reference", type=Path)
    b.add_argument("sets", type=Path, nargs="+")
    b.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.cmd == "images":
        images(args.folder, args.profile, args.out, args.count)
    else:
        table(args.reference, args.sets, args.out)


if __name__ == "__main__":
    main()
