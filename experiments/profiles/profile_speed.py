"""Does `--profile cpu-int8` reproduce today's best CPU speed? (issue 13, acceptance 4)

    .venv/bin/python experiments/profiles/profile_speed.py INT8_FOLDER [--repeats 15]

Times whole generations (1 prompt, DDIM 20 steps, guidance 4, one image) of an int8-static folder
loaded the way `generate` loads it without a profile, and with `--profile cpu-int8`, interleaved
so that background load hits both alike; prints medians and their ratio, writes
experiments/profiles/profile_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from onnxdiffusion.runtime import Pipeline  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "profile_speed.json")
    args = ap.parse_args(argv)
    pipes = {"int8 folder, no profile": Pipeline.from_folder(args.folder),
             "--profile cpu-int8": Pipeline.from_folder(args.folder, profile="cpu-int8"),
             "fp32 folder, no profile": Pipeline.from_folder(ROOT / "models" / "shapes-sd-onnx")}
    kw = dict(steps=20, sampler="ddim", guidance=4.0, seed=0)
    ref = {k: p("a red circle on the left", **kw).images for k, p in pipes.items()}  # warm-up
    assert np.array_equal(ref["int8 folder, no profile"], ref["--profile cpu-int8"]), "the profile changed the images"
    times = {k: [] for k in pipes}
    for _ in range(args.repeats):
        for k, p in pipes.items():
            t0 = time.perf_counter()
            p("a red circle on the left", **kw)
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {"repeats": args.repeats, "median_seconds": med,
              "profile_over_plain": med["--profile cpu-int8"] / med["int8 folder, no profile"],
              "int8_over_fp32": med["int8 folder, no profile"] / med["fp32 folder, no profile"],
              "images_identical": True}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for k, v in med.items():
        print(f"{k:26s} {v * 1e3:8.1f} ms / image (median of {args.repeats})")
    print(f"--profile cpu-int8 / plain int8: {result['profile_over_plain']:.3f}; int8 / fp32: {result['int8_over_fp32']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
