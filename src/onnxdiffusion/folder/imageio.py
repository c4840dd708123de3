"""Writing images: atomically, to an existing directory, one file per batch item."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from .artifacts import _umask
from .. import interrupts
from . import tempfiles
from ..errors import UserError

_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}


def output_paths(path: Path, count: int, overwrite: bool = False) -> list[Path]:
    """`out.png` for one image, `out-0.png`, `out-1.png`, ... for a batch; checked before any work:
    a known image suffix, an existing writable directory, and no existing file unless `overwrite`."""
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise UserError(f"output must end in one of {', '.join(_FORMATS)}: {path}")
    if not path.parent.is_dir():
        raise UserError(f"output directory does not exist: {path.parent}")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory is not writable: {path.parent}")
    paths = [path] if count == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]
    for p in paths:
        if p.is_dir():
            raise UserError(f"output {p} is a directory; name an image file")
        if (p.exists() or p.is_symlink()) and not overwrite:
            raise UserError(f"output {p} already exists (pass --overwrite to replace it)")
    return paths


def save_images(images: np.ndarray, path: Path, overwrite: bool = False) -> list[Path]:
    """All or nothing: every image is encoded to a temporary name first, then all are renamed."""
    paths = output_paths(path, len(images), overwrite)
    staged: list[tuple[str, Path]] = []
    done: list[Path] = []
    try:
        for img, p in zip(images, paths):
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format=_FORMATS[p.suffix.lower()])
            with tempfiles.deferred_signals():  # staged (and tracked) the instant it exists
                fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
                staged.append((tmp, p))
                tempfiles.track(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(buf.getvalue())
            os.chmod(tmp, 0o644 & ~_umask())
        interrupts.check()  # a Ctrl-C that a library caught while sampling or encoding: no image is published
        for tmp, p in staged:
            os.replace(tmp, p)
            done.append(p)
        for tmp, _ in staged:
            tempfiles.untrack(tmp)
    except BaseException:
        for tmp, _ in staged:
            tempfiles.remove(tmp)
        for p in done:  # an interrupted batch leaves none of its images
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise
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
