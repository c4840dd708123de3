"""`export MODEL.gguf OUT --base FOLDER`: a GGUF backbone (city96's ComfyUI-GGUF, stable-diffusion.cpp) exported with
its weights kept low-bit; text encoders, VAE, scheduler and tokenizers from --base, a diffusers folder of the same
model kind (its backbone's config.json is read, its backbone weights never).

The backbone module comes from export/gguf_backbone.py; the rest of export is the folder export's
(export/pipeline.py, with ExportOptions.gguf set), validation against PyTorch included: the PyTorch reference
computes with the same blocks, dequantized one layer at a time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..folder.artifacts import check_output_folder, write_manifest
from ..folder.manifest import Manifest, typed
from .gguf_backbone import check_file
from .gguf_file import read_gguf

__all__ = ["check_file", "export_gguf", "is_gguf"]
SUFFIX = ".gguf"


def is_gguf(path: Path) -> bool:
    """A .gguf name, or a file that starts with the GGUF magic."""
    if path.suffix.lower() == SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def export_gguf(src: Path | str, out: Path | str, options=None, base: Path | str | None = None,
                progress: bool = True) -> Manifest:
    """Export a GGUF backbone with the rest of --base; returns the manifest (its source: the GGUF file)."""
    from .options import ExportOptions
    from .pipeline import export_pipeline, source_info

    src, out = Path(src), Path(out)
    options = options or ExportOptions()
    if base is None:
        raise UserError(f"{src}: a GGUF file holds the backbone alone: give --base DIR, a local diffusers folder of "
                        f"the same model kind (its text encoders, VAE, scheduler, tokenizers and backbone config)")
    if options.loras or options.lora_points:
        raise UserError("--lora and --lora-points need float backbone weights; a GGUF backbone keeps its low-bit blocks")
    from .gguf_folder import export_into_folder, is_model_folder

    if is_model_folder(Path(base)):
        return export_into_folder(src, out, options, Path(base))
    gg = read_gguf(src)
    family, _ = source_info(base)
    check_file(gg, family)
    check_output_folder(out, options.overwrite, inputs=(src, Path(base)))
    draft = export_pipeline(base, out, replace(options, gguf=str(src)), progress=progress).to_dict()
    draft["source"] = {**draft["source"], "path": src.name, "gguf": True, "base": draft["source"]["path"]}
    write_manifest(out, draft)  # the manifest is not among the hashed files
    return typed(draft, str(out))
