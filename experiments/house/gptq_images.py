"""int4-weights algorithm=gptq is not deterministic (ONNX Runtime's GPTQ quantizer writes different bytes on two
runs of the same code), so behaviour_hashes.py cannot compare its files: compare its images instead.

    # once per checkout (PYTHONPATH picks the code), twice on one of them for the run-to-run spread
    PYTHONPATH=CHECKOUT/src python experiments/house/gptq_images.py run OUT.npz [--models sd,mmdit]
    python experiments/house/gptq_images.py compare A.npz B.npz [C.npz ...]

`run` quantizes both embedded models with behaviour_hashes.py's gptq case (block 16, 2 calibration steps,
4 prompts x 4 steps, 1 thread) and generates 8 held-out prompts (seeds 0-7, the model's recommended settings) with
the result. `compare` prints the PSNR of every pair of runs per model (min / median over the prompts): the spread
between two runs of one checkout is the noise the other pairs are read against.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import behaviour_hashes  # noqa: E402
from behaviour_hashes import CASES, MODELS, run_case  # noqa: E402

PROMPTS = ["a red circle on the left", "a blue square above a yellow triangle", "a small green star",
           "a large purple circle at the bottom", "an orange triangle on the right", "two blue circles",
           "a yellow square below a red star", "a green triangle in the middle"]


def run(out: Path, models: list[str]) -> None:
    import onnxdiffusion
    from onnxdiffusion.runtime import Pipeline

    # each checkout's own embedded models (the MMDiT folder gained a vae_encoder after the restaging)
    root = Path(onnxdiffusion.__file__).resolve().parents[2] / "models"
    behaviour_hashes.MODELS = {"sd": root / "shapes-sd-onnx", "mmdit": root / "shapes-mmdit-onnx"}
    case = next(c for c in CASES if c[0] == "int4-weights-gptq")
    images = {}
    with tempfile.TemporaryDirectory(prefix="gptq-images-") as scratch:
        for key in models:
            run_case(key, case, Path(scratch))
            pipe = Pipeline.from_folder(Path(scratch) / f"{key}-{case[0]}", threads=1)
            for i, prompt in enumerate(PROMPTS):
                images[f"{key}/{i}"] = pipe(prompt, seed=i).images[0]
                print(f"{key} {i}", flush=True)
    np.savez_compressed(out, **images)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def compare(paths: list[Path]) -> dict:
    runs = {p.stem: np.load(p) for p in paths}
    out = {}
    for (na, a), (nb, b) in itertools.combinations(runs.items(), 2):
        for key in sorted({k.split("/")[0] for k in a.files}):
            vals = sorted(psnr(a[k], b[k]) for k in a.files if k.startswith(key + "/"))
            out[f"{key}: {na} vs {nb}"] = {"min_db": round(vals[0], 2), "median_db": round(float(np.median(vals)), 2),
                                          "identical": sum(v == float("inf") for v in vals), "images": len(vals)}
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--models", default=",".join(MODELS))
    c = sub.add_parser("compare")
    c.add_argument("runs", type=Path, nargs="+")
    args = p.parse_args()
    if args.cmd == "run":
        run(args.out, args.models.split(","))
    else:
        compare(args.runs)


if __name__ == "__main__":
    main()
