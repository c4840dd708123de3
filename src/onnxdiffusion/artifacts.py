"""The model folder: manifest, component files, hashes, and atomic writes.

Layout (also loadable by optimum's ONNX Runtime diffusion pipeline):
  manifest.json, model_index.json, scheduler/, tokenizer/,
  text_encoder/model.onnx, unet/model.onnx, vae_decoder/model.onnx, vae_encoder/model.onnx
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, keyed by posix relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = sha256_file(p)
    return out


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` only if the block succeeds."""
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        raise UserError(f"output directory's parent does not exist: {parent}")
    if final.exists() and not overwrite:
        if final.is_file() or any(final.iterdir()):
            raise UserError(f"output {final} already exists (pass --overwrite to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        if final.is_dir():
            shutil.rmtree(final)
        else:
            final.unlink()
    os.replace(tmp, final)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"output directory does not exist: {path.parent}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_manifest(folder: Path) -> dict:
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise UserError(f"model path is not a folder: {folder}")
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(f"{folder} is not an onnxdiffusion model folder (no {MANIFEST}; run `onnxdiffusion export` first)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: unsupported format_version {manifest.get('format_version')!r}")
    return manifest


def verify_folder(folder: Path, manifest: dict, components: tuple[str, ...] | None = None) -> None:
    """Fail loudly on a missing component or a file whose hash differs from the manifest.

    `components`: those that must be there; default: what the folder's model family requires."""
    folder = Path(folder)
    if components is None:
        from .families import get_family

        family = get_family(manifest.get("family"))
        family.check_folder(str(folder), manifest)
        components = family.required_components(manifest.get("pipeline", {}))
    for name in components:
        info = manifest.get("components", {}).get(name)
        if info is None:
            raise UserError(f"{folder}: manifest has no '{name}' component")
        if not (folder / info["path"]).is_file():
            raise UserError(f"{folder}: component '{name}' is missing ({info['path']})")
    for rel, digest in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            raise UserError(f"{folder}: file listed in manifest is missing: {rel}")
        if sha256_file(p) != digest:
            raise UserError(f"{folder}: {rel} does not match its sha256 in {MANIFEST} (corrupt or modified)")
