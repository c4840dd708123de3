#!/usr/bin/env python
"""Qwen-Image-Edit's VL text encoder at 8- and 4-bit weight-only (issue 42, acceptance 3): te_weight_only.py's
measurement on an edit. `quantize --recipe weights-only` on the text encoder alone converts every MatMul with a
constant weight (the decoder layers'); the vision tower runs its linears as Gemms over patch rows, kept float
unless `-O gemms=quantize` (then they are rewritten as MatMuls and converted as well; the patch embedding is a
convolution and stays float); the transformer, the VAE encoder and decoder stay fp32. Each pair is a prompt, a seed and a reference picture of its
own (random pixels, 48 x 80); the edit is drawn at 64 x 96 with true CFG against a negative prompt, and compared
with the fp32 folder's on the same inputs.

The tiny pipeline is the tests' (tests/helpers/tiny_qwenedit.py: a 2-layer Qwen2.5-VL text model of width 16 with
a 2-block vision tower, random weights), so the blocks are 16 wide (the recipe's smallest).

    python experiments/llm_text_encoders/te_weight_only_edit.py [--work DIR] [--pairs 8]
        -> experiments/llm_text_encoders/te_weight_only_edit.json and .md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from te_weight_only import BLOCK, PROMPTS, ROOT, STEPS, table  # noqa: E402

H, W, GUIDANCE, NEGATIVE = 64, 96, 4.0, "blurry"


def _export(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from tiny_qwenedit import build_tiny_qwenedit

    from onnxdiffusion.export import ExportOptions, export_pipeline

    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    built = build_tiny_qwenedit(src)
    out = work / "fp32"
    export_pipeline(built, out, ExportOptions(default_size=64, overwrite=True), progress=False)
    return out


def _weight_only(folder: Path, out: Path, bits: int, gemms: str) -> int:
    """`quantize --recipe weights-only -O bits=BITS,block_size=16,gemms=GEMMS`; returns the text encoder's bytes."""
    import shutil

    from onnxdiffusion.quantize import QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    shutil.rmtree(out, ignore_errors=True)
    recipe = recipe_class("weights-only").with_options({"bits": str(bits), "block_size": str(BLOCK), "gemms": gemms})
    quantize(folder, out, QuantizeConfig(recipe=recipe, latency_runs=2, measure_memory=False))
    return (out / "text_encoder" / "model.onnx").stat().st_size


def _picture(seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(100 + seed).integers(0, 256, (48, 80, 3), dtype=np.uint8))


def measure(work: Path, pairs: int) -> dict:
    import numpy as np

    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    fp32 = _export(work)
    sizes = {"fp32": (fp32 / "text_encoder" / "model.onnx").stat().st_size}
    folders = {"fp32": fp32}
    for gemms in ("keep", "quantize"):
        for bits in (8, 4):
            name = f"int{bits}-weights" + ("" if gemms == "keep" else " gemms=quantize")
            folders[name] = work / name.replace(" ", "-")
            sizes[name] = _weight_only(fp32, folders[name], bits, gemms)
    pipes = {k: Pipeline.from_folder(f, verify=False) for k, f in folders.items()}
    images = {k: [] for k in pipes}
    for i, prompt in enumerate(PROMPTS[:pairs]):
        for k, pipe in pipes.items():
            images[k].append(pipe(prompt, image=_picture(i), negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE,
                                  height=H, width=W, seed=i).images)
    ref = np.concatenate(images["fp32"])
    return {"qwenimage_edit": {k: {"te_bytes": sizes[k], "size_ratio": round(sizes["fp32"] / sizes[k], 2), **({} if k == "fp32" else {
        "worst_psnr_db": round(float(min(psnr(a, b) for a, b in zip(images[k], images["fp32"]))), 2),
        "all_psnr_db": round(float(psnr(np.concatenate(images[k]), ref)), 2)})} for k in pipes}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "te_weight_only_edit")
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    import onnxruntime

    result = {"families": measure(args.work, args.pairs), "pairs": args.pairs, "steps": STEPS, "size": [H, W],
              "picture": [48, 80], "guidance": GUIDANCE, "block_size": BLOCK, "onnxruntime": onnxruntime.__version__,
              "machine": platform.machine()}
    here = Path(__file__).parent
    (here / "te_weight_only_edit.json").write_text(json.dumps(result, indent=1) + "\n")
    (here / "te_weight_only_edit.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
