"""FLUX.2's LLM text encoder quantized weight-only (every MatMul to ONNX Runtime's MatMulNBits, 8 and 4 bit):
the text encoder's size and the final image's PSNR against the fp32 folder's, prompt by prompt (issue 42,
acceptance 3). The backbone and VAE stay fp32, so the PSNR is the text encoder's alone.

    python experiments/flux2/text_encoder_weight_only.py --out experiments/flux2/text_encoder_weight_only.json

Without --klein/--dev the tiny random-weight pipelines of tests/helpers/tiny_flux2.py are built and exported
into a temporary folder (random weights: the figures say the path works and what it costs in size; quality on
a trained model is for the release weights).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a small red circle on the left", "a large blue square above a green ring", "a yellow star",
           "two violet triangles on a white background"]
FORMS = {"int8": (8, 32), "int4": (4, 32)}  # bits, block size


def _matmul_weight_bytes(model) -> int:
    """Bytes of the weights the MatMuls read: fp32 initializers, or MatMulNBits' packed blocks + scales + zero points."""
    inits = {t.name: t for t in model.graph.initializer}
    total = 0
    for n in model.graph.node:
        names = n.input[1:2] if n.op_type == "MatMul" else n.input[1:4] if n.op_type == "MatMulNBits" else []
        for name in names:
            if name in inits:
                t = inits[name]
                total += len(t.raw_data) or 4 * int(np.prod(t.dims))
    return total


def _quantized_copy(src: Path, out: Path, bits: int, block: int) -> tuple[int, int]:
    """A copy of `src` whose text encoder's MatMul weights are `bits`-bit blocks; returns (file bytes, the MatMul
    weights' bytes)."""
    import onnx

    from onnxdiffusion.quantize._ort import int4_quantize

    shutil.copytree(src, out)
    path = out / "text_encoder" / "model.onnx"
    model = onnx.load(str(path))
    nodes = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    quant = int4_quantize(model, nodes, block_size=block, symmetric=True, accuracy_level=0, bits=bits)
    for f in (out / "text_encoder").glob("model.onnx*"):
        f.unlink()
    onnx.save(quant, str(path))
    return sum(f.stat().st_size for f in (out / "text_encoder").glob("model.onnx*")), _matmul_weight_bytes(quant)


def measure(folder: Path, work: Path, steps: int, size: tuple[int, int]) -> dict:
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    fp32 = Pipeline.from_folder(folder)
    kw = dict(steps=steps, height=size[0], width=size[1])
    base = [fp32(p, seed=i, **kw).images for i, p in enumerate(PROMPTS)]
    import onnx

    te_bytes = sum(f.stat().st_size for f in (folder / "text_encoder").glob("model.onnx*"))
    mm_bytes = _matmul_weight_bytes(onnx.load(str(folder / "text_encoder" / "model.onnx")))
    rows = {"fp32": {"text_encoder_bytes": te_bytes, "matmul_weight_bytes": mm_bytes, "psnr_db": None}}
    for name, (bits, block) in FORMS.items():
        out = work / f"{folder.name}-{name}"
        nbytes, nmm = _quantized_copy(folder, out, bits, block)
        pipe = Pipeline.from_folder(out, verify=False)  # the copy's hashes are the fp32 folder's
        got = [psnr(pipe(p, seed=i, **kw).images, b) for i, (p, b) in enumerate(zip(PROMPTS, base))]
        rows[name] = {"text_encoder_bytes": nbytes, "ratio": round(te_bytes / nbytes, 2), "matmul_weight_bytes": nmm,
                      "matmul_weight_ratio": round(mm_bytes / nmm, 2),
                      "psnr_db_median": float(np.median(got)), "psnr_db_min": float(np.min(got)),
                      "psnr_db": [round(float(v), 2) for v in got]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--klein", type=Path, help="an exported FLUX.2 [klein] folder (default: the tiny one)")
    ap.add_argument("--dev", type=Path, help="an exported FLUX.2 [dev] folder (default: the tiny one)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folders = {"flux2_klein": args.klein, "flux2": args.dev}
        if None in folders.values():
            sys.path.insert(0, str(ROOT / "tests" / "helpers"))
            sys.path.insert(0, str(ROOT / "models" / "training"))
            from tiny_flux2 import build_tiny_flux2_dev, build_tiny_flux2_klein

            from onnxdiffusion.export import ExportOptions, export_pipeline

            for key, build in (("flux2_klein", build_tiny_flux2_klein), ("flux2", build_tiny_flux2_dev)):
                if folders[key] is None:
                    src = build(tmp)
                    folders[key] = tmp / f"{key}-onnx"
                    export_pipeline(src, folders[key], ExportOptions(
                        default_size=32, components=("text_encoder", "transformer", "vae_decoder")), progress=False)
        result = {key: measure(folder, tmp, args.steps, (24, 40)) for key, folder in folders.items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
