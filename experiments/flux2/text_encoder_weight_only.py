"""FLUX.2's LLM text encoder weight-only (issue 42, acceptance 3), measured as experiments/llm_text_encoders/
te_weight_only.py measures Z-Image's and Qwen-Image's, so the rows sit in the same table: `quantize --recipe
weights-only -O bits=8|4,block_size=16` on the text encoder alone (every MatMul with a constant weight to ONNX
Runtime's MatMulNBits), backbone and VAE fp32, 8 prompt-seed pairs at 48 x 32, 4 steps, image PSNR vs the fp32
folder over all pairs and the worst pair.

    python experiments/flux2/text_encoder_weight_only.py [--klein K --dev D] [--work DIR]
        -> experiments/flux2/text_encoder_weight_only.json and .md

K and D: exported FLUX.2 folders; without them the tiny random-weight pipelines of tests/helpers/tiny_flux2.py
(a 28-layer Qwen3, a 31-layer Mistral language model, both 16 wide) are built and exported into the work folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a small red circle on the left", "a blue square above a yellow triangle", "a green ring on the right",
           "two violet stars", "a big orange circle below a small blue square", "a yellow star in the middle",
           "a red triangle and a green circle", "a blue ring above a red square"]
FAMILIES = {"flux2_klein": ("build_tiny_flux2_klein", 4.0), "flux2": ("build_tiny_flux2_dev", 3.5)}
H, W, STEPS, BLOCK = 48, 32, 4, 16


def _export(work: Path, family: str) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    sys.path.insert(0, str(ROOT / "models" / "training"))
    import tiny_flux2

    from onnxdiffusion.export import ExportOptions, export_pipeline

    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    built = getattr(tiny_flux2, FAMILIES[family][0])(src)
    out = work / f"{family}-fp32"
    export_pipeline(built, out, ExportOptions(components=("text_encoder", "transformer", "vae_decoder"), default_size=32,
                                              overwrite=True), progress=False)
    return out


def _weight_only(folder: Path, out: Path, bits: int) -> int:
    from onnxdiffusion.quantize import QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe = recipe_class("weights-only").with_options({"bits": str(bits), "block_size": str(BLOCK)})
    quantize(folder, out, QuantizeConfig(recipe=recipe, latency_runs=2, measure_memory=False))
    return sum(f.stat().st_size for f in (out / "text_encoder").glob("model.onnx*"))


def measure(work: Path, given: dict[str, Path | None]) -> dict:
    import numpy as np

    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    rows = {}
    for family, (_, guidance) in FAMILIES.items():
        fp32 = given.get(family) or _export(work / family, family)
        sizes = {"fp32": sum(f.stat().st_size for f in (fp32 / "text_encoder").glob("model.onnx*"))}
        folders = {"fp32": fp32}
        for bits in (8, 4):
            name = f"int{bits}-weights"
            folders[name] = work / family / name
            sizes[name] = _weight_only(fp32, folders[name], bits)
        pipes = {k: Pipeline.from_folder(f, verify=False) for k, f in folders.items()}
        images = {k: [pipe(p, steps=STEPS, guidance=guidance, height=H, width=W, seed=i).images
                      for i, p in enumerate(PROMPTS)] for k, pipe in pipes.items()}
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
    ap.add_argument("--klein", type=Path, help="an exported FLUX.2 [klein] folder (default: the tiny one, built)")
    ap.add_argument("--dev", type=Path, help="an exported FLUX.2 [dev] folder (default: the tiny one, built)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "flux2_te_weight_only")
    args = ap.parse_args()
    import onnxruntime

    result = {"families": measure(args.work, {"flux2_klein": args.klein, "flux2": args.dev}), "pairs": len(PROMPTS),
              "steps": STEPS, "size": [H, W], "block_size": BLOCK, "onnxruntime": onnxruntime.__version__}
    here = Path(__file__).parent
    (here / "text_encoder_weight_only.json").write_text(json.dumps(result, indent=1) + "\n")
    (here / "text_encoder_weight_only.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
