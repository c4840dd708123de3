"""Writing images: atomically, to an existing directory, one file per batch item."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from .artifacts import atomic_write_bytes
from .errors import UserError

_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}


def output_paths(path: Path, count: int) -> list[Path]:
    """`out.png` for one image, `out-0.png`, `out-1.png`, ... for a batch; checked before any work."""
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise UserError(f"output must end in one of {', '.join(_FORMATS)}: {path}")
    if not path.parent.is_dir():
        raise UserError(f"output directory does not exist: {path.parent}")
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]


def save_images(images: np.ndarray, path: Path) -> list[Path]:
    paths = output_paths(path, len(images))
    for img, p in zip(images, paths):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format=_FORMATS[p.suffix.lower()])
        atomic_write_bytes(p, buf.getvalue())
    return paths


def image_grid(images: np.ndarray, columns: int) -> np.ndarray:
    """Tile (N, H, W, 3) images into one (rows*H, columns*W, 3) image; empty cells stay black."""
    n, h, w, c = images.shape
    rows = -(-n // columns)
    grid = np.zeros((rows * h, columns * w, c), images.dtype)
    for i, img in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = img
    return grid
