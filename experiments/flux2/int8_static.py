"""FLUX.2 with an int8-static backbone (and with int4-weights, the low-bit recipe): quantize's own probe PSNR and
the final image's PSNR against the fp32 folder on held-out prompt-seed pairs (issue 42, acceptance 1).

    python experiments/flux2/int8_static.py --klein K --dev D --out experiments/flux2/int8_static.json

K and D are exported FLUX.2 folders (the tiny ones: tests/helpers/tiny_flux2.py built and exported as
tests/conftest.py does). Random weights: the figures say the recipes run on these graphs and what they do to a
random model's image, not the quality on the release weights.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = ["a small red circle on the left", "a large blue square above a green ring", "a yellow star",
           "two violet triangles on a white background"]
RECIPES = {"int8-static": {}, "int4-weights": {"block_size": "16"}}


def measure(folder: Path, work: Path, guidance: float) -> dict:
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class
    from onnxdiffusion.runtime import Pipeline

    kw = dict(steps=4, guidance=guidance, height=24, width=40)
    fp32 = Pipeline.from_folder(folder)
    base = [fp32(p, seed=100 + i, **kw).images for i, p in enumerate(PROMPTS)]
    rows = {}
    for name, options in RECIPES.items():
        out = work / f"{folder.name}-{name}"
        report = quantize(folder, out, QuantizeConfig(
            recipe=recipe_class(name).with_options(options),
            calibration=CalibrationConfig(count=8, steps=4, batch=4, sampler="flow_euler"),
            latency_runs=3, measure_memory=False))
        pipe = Pipeline.from_folder(out)
        got = [psnr(pipe(p, seed=100 + i, **kw).images, b) for i, (p, b) in enumerate(zip(PROMPTS, base))]
        rows[name] = {"probe_psnr_db": report["quality"]["probe_psnr_db"], "image_psnr_db_median": float(np.median(got)),
                      "image_psnr_db": [round(float(v), 2) for v in got], "verdict": report["verdict"]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--klein", type=Path, required=True)
    ap.add_argument("--dev", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"flux2_klein": measure(args.klein, Path(tmp), 4.0), "flux2": measure(args.dev, Path(tmp), 3.5)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
