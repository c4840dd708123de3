"""Where the shipped artifacts live (the repo's models/ folder, or $ONNXDIFFUSION_MODELS)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError

EMBEDDED_NAME = "shapes-sd"


def models_root() -> Path:
    """$ONNXDIFFUSION_MODELS, else the source checkout's models/ (editable install), else ./models."""
    env = os.environ.get("ONNXDIFFUSION_MODELS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3] / "models"  # src/onnxdiffusion/folder/paths.py -> the checkout
    return repo if repo.is_dir() else Path.cwd() / "models"


def default_model_folder() -> Path:
    """The embedded model, exported to ONNX and shipped so that run time never needs torch."""
    folder = models_root() / f"{EMBEDDED_NAME}-onnx"
    if not folder.is_dir():
        raise UserError(f"embedded model not found at {folder} (set ONNXDIFFUSION_MODELS or pass a MODEL folder)")
    return folder


def embedded_diffusers_folder() -> Path:
    return models_root() / EMBEDDED_NAME


def shown_path(path) -> str | None:
    """A folder as committed results may name it: relative to the working directory when inside it, else only
    its last two parts behind `.../` (results name no absolute path of the machine they were made on)."""
    if path is None:
        return None
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path("...", *p.resolve().parts[-2:])) if p.is_absolute() or ".." in p.parts else str(p)
