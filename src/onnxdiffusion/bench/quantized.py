"""`bench --quantize RECIPE[,RECIPE]`: the quantized siblings of the benched model, built inside the run.

Each is `onnxdiffusion quantize MODEL FOLDER --recipe RECIPE` in a subprocess (its memory peak, ~9 GB on the
full-size UNet, is given back before anything is measured), into a cache folder named by a content hash: the
model's file hashes (its manifest's `files` list), its pipeline block, the recipe, the quantize arguments and
this package's version. A second run with the same inputs reuses the folder; any change makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..folder.artifacts import MANIFEST, read_manifest
from ..errors import UserError
from .variants import KNOWN_RECIPES


def parse_recipes(items) -> tuple[str, ...]:
    """'int8-static,fp16' (or repeated) -> ('int8-static', 'fp16'); unknown names fail before anything runs."""
    names = tuple(dict.fromkeys(n.strip() for item in items or () for n in str(item).split(",") if n.strip()))
    unknown = [n for n in names if n not in KNOWN_RECIPES]
    if unknown:
        raise UserError(f"--quantize: unknown recipe {unknown[0]!r}; choose from {', '.join(KNOWN_RECIPES)}")
    return names


def content_key(model: Path, recipe: str, args: tuple[str, ...]) -> str:
    from .. import __version__

    manifest = read_manifest(model)
    # plain JSON values, as read: the key of a folder built before must not change
    what = {"files": dict(manifest.files), "pipeline": manifest.pipeline.to_dict(), "family": manifest.family,
            "recommended": manifest.recommended.to_dict(), "recipe": recipe, "args": list(args), "version": __version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def sibling_folder(cache: Path, model: Path, recipe: str, args: tuple[str, ...]) -> Path:
    return Path(cache) / f"{recipe}-{content_key(model, recipe, args)[:16]}"


def build_siblings(model: Path, recipes: tuple[str, ...], cache: Path, args: tuple[str, ...] = (),
                   threads: int | None = None, progress: bool = True) -> tuple[list[Path], list[dict]]:
    """(one quantized folder per recipe, a record per recipe: folder, cached or seconds, command)."""
    folders, records = [], []
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    for recipe in recipes:
        cmd_args = (*args, "--threads", str(threads or 1))
        folder = sibling_folder(cache, model, recipe, cmd_args)
        rec = {"recipe": recipe, "folder": folder.name, "quantize_args": list(cmd_args)}
        if (folder / MANIFEST).is_file():
            rec["cached"] = True
            print(f"bench: --quantize {recipe}: reusing {folder} (same model files, recipe and arguments)",
                  file=sys.stderr, flush=True)
        else:
            cmd = [sys.executable, "-m", "onnxdiffusion.cli", "quantize", str(model), str(folder), "--recipe", recipe,
                   *cmd_args, "--overwrite"]
            print(f"bench: --quantize {recipe}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL,
                                  stderr=None if progress else subprocess.PIPE, text=True, env={**os.environ})
            if proc.returncode != 0:
                tail = ((proc.stderr or "").strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
                raise UserError(f"--quantize {recipe}: quantize failed: {tail}")
            rec.update(cached=False, seconds=round(time.perf_counter() - t0, 1))
        folders.append(folder)
        records.append(rec)
    return folders, records


def default_cache(work: Path | None) -> Path:
    if work is not None:
        return Path(work) / "quantized"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxdiffusion" / "bench-quantized"
