"""Ship the distilled tiny autoencoder (train_tiny_vae.py) into the embedded models.

Usage: python models/training/ship_tiny_vae.py runs/tiny-vae/vae_tiny

Writes models/shapes-sd/vae_tiny (float16 safetensors; config.json with shapes-sd's VAE scaling) and
models/shapes-mmdit/vae_tiny (config.json with the MMDiT's VAE scaling and shift; its weights a link to
shapes-sd's, as its VAE's are: the two models share the VAE, and the tiny model decodes raw latents),
then adds vae_decoder_tiny to both ONNX folders, stored as float16 + Cast (what `relayout --storage fp16`
does; lossless, the weights being float16 values). Only the decoder is shipped in the ONNX folders: the
run time decodes with it (`--decoder tiny`, serve's previews); nothing there encodes with the tiny encoder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "diffusion_pytorch_model.safetensors"
TARGETS = (("shapes-sd", "shapes-sd-onnx"), ("shapes-mmdit", "shapes-mmdit-onnx"))


def diffusers_folder(trained: Path, source: str) -> Path:
    """models/<source>/vae_tiny: the trained config with this model's VAE scaling / shift."""
    from safetensors.torch import load_file, save_file

    vae = json.loads((ROOT / "models" / source / "vae" / "config.json").read_text())
    out = ROOT / "models" / source / "vae_tiny"
    out.mkdir(exist_ok=True)
    cfg = json.loads((trained / "config.json").read_text())
    cfg.update(scaling_factor=vae["scaling_factor"], shift_factor=vae.get("shift_factor") or 0.0,
               _name_or_path="runs/tiny-vae/vae_tiny")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    weights = out / WEIGHTS
    if source == "shapes-sd":
        tensors = {k: v.half() for k, v in load_file(trained / WEIGHTS).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
        weights.chmod(0o644)
    else:
        weights.unlink(missing_ok=True)
        os.symlink(f"../../shapes-sd/vae_tiny/{WEIGHTS}", weights)
    return out


def add_to_onnx(tiny: Path, folder: Path) -> None:
    """vae_decoder_tiny into `folder` in place; every other file byte for byte as it was."""
    from onnxdiffusion.export.tiny_vae import add_tiny_vae
    from onnxdiffusion.families.tiny_vae import DECODER
    from onnxdiffusion.folder.relayout import store_external

    before = json.loads((folder / "manifest.json").read_text())["files"]
    with tempfile.TemporaryDirectory() as tmp:
        added, stored = Path(tmp) / "added", Path(tmp) / "stored"
        add_tiny_vae(folder, tiny, added, names=(DECODER,))
        rewritten = store_external(added, stored, storage="fp16")
        assert rewritten == [DECODER], rewritten  # nothing else of the folder is rewritten
        manifest = json.loads((stored / "manifest.json").read_text())
        # a re-ship replaces the old tiny decoder's files; every other file keeps its digest
        kept = {rel: digest for rel, digest in before.items() if not rel.startswith(DECODER + "/")}
        assert all(manifest["files"][rel] == digest for rel, digest in kept.items())
        shutil.rmtree(folder / DECODER, ignore_errors=True)
        shutil.copytree(stored / DECODER, folder / DECODER)
        shutil.copy2(stored / "manifest.json", folder / "manifest.json")
    print(folder, manifest["components"][DECODER]["bytes"], "bytes")


def main() -> None:
    trained = Path(sys.argv[1])
    for source, onnx_folder in TARGETS:
        add_to_onnx(diffusers_folder(trained, source), ROOT / "models" / onnx_folder)


if __name__ == "__main__":
    main()
