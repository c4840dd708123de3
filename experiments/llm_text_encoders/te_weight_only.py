#!/usr/bin/env python
"""The LLM text encoders' weight-only forms on the image (issue 42, acceptance 3): `quantize --recipe weights-only`
(docs/recipes/weights-only.md) on the text encoder alone: every MatMul with a constant weight (the decoder layers'
q/k/v/o and MLP projections; the token embedding Gather stays float) becomes ONNX Runtime's MatMulNBits at 8 or 4
bits, the backbone and the VAE stay fp32, and the images are compared with the fp32 folder's on the same prompts
and initial latents.

The tiny pipelines are the tests' (tests/helpers/tiny_families.py: Z-Image's 3-layer Qwen3, Qwen-Image's 2-layer
Qwen2.5-VL text model; tests/helpers/tiny_flux2.py: FLUX.2 [klein]'s 28-layer Qwen3, [dev]'s 31-layer Mistral
language model; random weights). Their hidden widths are 16 to 24, so the blocks are 16 wide (the recipe's
smallest; released encoders take 32-128). A text encoder's bytes count every model.onnx* file (external data too).

    python experiments/llm_text_encoders/te_weight_only.py [--work DIR (default: the temporary folder)] [--pairs 8]
        -> experiments/llm_text_encoders/te_weight_only.json and .md
    python experiments/llm_text_encoders/te_weight_only.py --families flux2_klein,flux2 [--folder flux2_klein=K
        --folder flux2=D] --out experiments/flux2/text_encoder_weight_only
        -> FLUX.2's rows (issue 42, acceptance 3), beside its other results; K, D: exported folders (default: the
           tiny pipelines, built and exported into the work folder)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a small red circle on the left", "a blue square above a yellow triangle", "a green ring on the right",
           "two violet stars", "a big orange circle below a small blue square", "a yellow star in the middle",
           "a red triangle and a green circle", "a blue ring above a red square"]
# family -> (the tests' helper module, its builder, guidance)
FAMILIES = {"zimage": ("tiny_families", "build_tiny_zimage", 3.0), "qwenimage": ("tiny_families", "build_tiny_qwenimage", 4.0),
            "flux2_klein": ("tiny_flux2", "build_tiny_flux2_klein", 4.0), "flux2": ("tiny_flux2", "build_tiny_flux2_dev", 3.5)}
H, W, STEPS, BLOCK = 48, 32, 4, 16


def _export(work: Path, family: str) -> Path:
    import importlib

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    sys.path.insert(0, str(ROOT / "models" / "training"))
    from onnxdiffusion.export import ExportOptions, export_pipeline

    module, builder, _ = FAMILIES[family]
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    built = getattr(importlib.import_module(module), builder)(src)
    out = work / f"{family}-fp32"
    export_pipeline(built, out, ExportOptions(components=("text_encoder", "transformer", "vae_decoder"), default_size=32,
                                              overwrite=True), progress=False)
    return out


def _weight_only(folder: Path, out: Path, bits: int) -> int:
    """`quantize --recipe weights-only -O bits=BITS,block_size=16` (the text encoder alone); returns its bytes."""
    from onnxdiffusion.quantize import QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe = recipe_class("weights-only").with_options({"bits": str(bits), "block_size": str(BLOCK)})
    quantize(folder, out, QuantizeConfig(recipe=recipe, latency_runs=2, measure_memory=False))
    return _te_bytes(out)


def _te_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in (folder / "text_encoder").glob("model.onnx*"))


def measure(work: Path, pairs: int, families: list[str], given: dict[str, Path]) -> dict:
    import numpy as np

    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    rows = {}
    for family in families:
        guidance = FAMILIES[family][2]
        fp32 = given.get(family) or _export(work / family, family)
        sizes = {"fp32": _te_bytes(fp32)}
        folders = {"fp32": fp32}
        for bits in (8, 4):
            name = f"int{bits}-weights"
            folders[name] = work / family / name
            sizes[name] = _weight_only(fp32, folders[name], bits)
        pipes = {k: Pipeline.from_folder(f, verify=False) for k, f in folders.items()}
        images = {k: [] for k in pipes}
        for i, prompt in enumerate(PROMPTS[:pairs]):
            for k, pipe in pipes.items():
                images[k].append(pipe(prompt, steps=STEPS, guidance=guidance, height=H, width=W, seed=i).images)
        ref = np.concatenate(images["fp32"])
        rows[family] = {k: {"te_bytes": sizes[k], "size_ratio": round(sizes["fp32"] / sizes[k], 2),
                            **({} if k == "fp32" else {
                                "worst_psnr_db": round(float(min(psnr(a, b) for a, b in zip(images[k], images["fp32"]))), 2),
                                "all_psnr_db": round(float(psnr(np.concatenate(images[k]), ref)), 2)})}
                        for k in pipes}
    return rows


def table(result: dict) -> str:
    lines = ["| family | text encoder | bytes | smaller | image PSNR vs fp32 (all pairs) | worst pair |",
             "|---|---|---|---|---|---|"]
    for family, forms in result["families"].items():
        for k, r in forms.items():
            psnr = f"{r['all_psnr_db']:.1f} dB" if "all_psnr_db" in r else "-"
            worst = f"{r['worst_psnr_db']:.1f} dB" if "worst_psnr_db" in r else "-"
            lines.append(f"| {family} | {k} | {r['te_bytes']} | {r['size_ratio']:.2f}x | {psnr} | {worst} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "te_weight_only")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--families", default="zimage,qwenimage", help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--folder", action="append", default=[], metavar="FAMILY=PATH",
                    help="an exported fp32 folder of FAMILY (default: its tiny pipeline, built and exported)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "te_weight_only",
                    help="the results' path without suffix (.json and .md are written)")
    args = ap.parse_args()
    families = args.families.split(",")
    given = dict(f.split("=", 1) for f in args.folder)
    unknown = [f for f in [*families, *given] if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown family {unknown[0]!r}; one of {', '.join(FAMILIES)}")
    import onnxruntime

    result = {"families": measure(args.work, args.pairs, families, {k: Path(v) for k, v in given.items()}),
              "pairs": args.pairs, "steps": STEPS, "size": [H, W], "block_size": BLOCK,
              "onnxruntime": onnxruntime.__version__, "machine": platform.machine()}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
