"""`export CHECKPOINT.safetensors OUT --config DIR`: a single-file checkpoint (the A1111 / ComfyUI layout)
through diffusers' `from_single_file`, offline.

diffusers maps the original keys to its modules; what the checkpoint does not hold (component
configs, tokenizers, the scheduler) comes from `--config`, a local diffusers folder of the same model
kind. Its weights are read only for a component the checkpoint lacks entirely (an SD3 file without
T5, a Flux file with the transformer alone); the manifest's source lists those (`from_config`). The package ships no tokenizers (the repository's size budget), so
--config is required. The checkpoint becomes a temporary diffusers folder beside OUT, exported as any
folder is, then removed; the manifest names the checkpoint as the source. Pickle checkpoints (.ckpt)
are refused: loading one can run code.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

from ..folder.artifacts import check_output_folder, write_manifest
from ..folder.manifest import Manifest, typed
from ..errors import UserError
from ..families import family_for_pipeline, get_family

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")


def check_checkpoint(src: Path) -> None:
    """Refuse pickles and anything that is not a safetensors file, reading only its first bytes."""
    if src.suffix.lower() in PICKLE_SUFFIXES:
        raise UserError(f"{src}: a pickle checkpoint ({src.suffix}); only .safetensors checkpoints are exported "
                        f"(loading a pickle can run code)")
    try:
        with open(src, "rb") as f:
            head = f.read(9)
            n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    except OSError as e:
        raise UserError(f"cannot read {src}: {e.strerror}") from None
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK"):
        raise UserError(f"{src}: a pickle checkpoint; only safetensors checkpoints are exported (pickle can run code)")
    if len(head) < 9 or head[8:9] != b"{" or n > src.stat().st_size:
        raise UserError(f"{src}: not a diffusers pipeline folder, and not a safetensors file (a single-file checkpoint)")


def _pipeline_class(config: Path, family: str | None) -> str:
    index = config / "model_index.json"
    if not index.is_file():
        raise UserError(f"--config {config}: not a diffusers folder (no model_index.json)")
    try:
        name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError, OSError):
        raise UserError(f"{index}: not a diffusers model_index.json") from None
    found = family_for_pipeline(name)
    if family is not None and get_family(family).name != found.name:
        raise UserError(f"--family {family} but --config {config} is a {found.name} pipeline ({name})")
    return name


def materialize(src: Path, config: Path | None, family: str | None, work: Path) -> tuple[Path, list[str]]:
    """The checkpoint as a diffusers folder under `work` (weights from the checkpoint, the rest from --config);
    returns it and the components whose weights came from --config (the checkpoint holds none)."""
    check_checkpoint(src)
    if config is None:
        raise UserError(f"{src}: a single-file checkpoint needs --config DIR, a local diffusers folder of the same "
                        f"model kind (its configs and tokenizers; its weights only for a component the file lacks)")
    config = Path(config)
    class_name = _pipeline_class(config, family)
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is None or not hasattr(cls, "from_single_file"):
        raise UserError(f"{class_name} cannot load single-file checkpoints in this diffusers")
    pipe, from_config = _load(cls, src, config, class_name)
    folder = work / "diffusers"
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder, from_config


def _load(cls, src: Path, config: Path, class_name: str):
    """diffusers' from_single_file; a component the file does not hold (an SD3 file without T5, a Flux file with
    the transformer alone: the usual way they are shared) is loaded from --config, as diffusers' own error
    advises. Returns (pipeline, names of the components taken from --config)."""
    import re

    from diffusers.loaders.single_file_utils import SingleFileComponentError

    given: dict = {}
    while True:
        try:
            return cls.from_single_file(str(src), config=str(config), local_files_only=True, **given), sorted(given)
        except SingleFileComponentError as e:
            # diffusers names the missing component only in its advice: "<name> = <Class>.from_pretrained('...')"
            m = re.search(r"^(\w+) = (\w+)\.from_pretrained", str(e), re.M)
            if m is None or m[1] in given:
                raise UserError(f"{src}: diffusers could not read this checkpoint as a {class_name}: "
                                f"{_first_line(e)}") from None
            given[m[1]] = _component_from_config(config, m[1], m[2], src)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:
            raise UserError(f"{src}: diffusers could not read this checkpoint as a {class_name}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def _component_from_config(config: Path, name: str, class_name: str, src: Path):
    import importlib

    index = json.loads((config / "model_index.json").read_text())
    library = (index.get(name) or [None])[0]
    cls = getattr(importlib.import_module(library), class_name, None) if library in ("diffusers", "transformers") else None
    if cls is None or not (config / name).is_dir():
        raise UserError(f"{src}: the checkpoint holds no {name} weights and --config {config} has no {name} folder to "
                        f"take them from")
    try:
        return cls.from_pretrained(str(config), subfolder=name, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise UserError(f"{src}: the checkpoint holds no {name} weights and --config {config}/{name} cannot be "
                        f"loaded: {_first_line(e)}") from None


def export_checkpoint(src: Path | str, out: Path | str, options=None, config: Path | str | None = None,
                      family: str | None = None, progress: bool = True) -> Manifest:
    """Export a single-file checkpoint; returns the manifest (its source: the checkpoint file)."""
    from .pipeline import ExportOptions, export_pipeline

    src, out = Path(src), Path(out)
    options = options or ExportOptions()
    check_checkpoint(src)
    check_output_folder(out, options.overwrite, inputs=(src,))
    if not out.parent.is_dir():
        raise UserError(f"output directory does not exist: {out.parent}")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".ckpt", dir=out.parent))
    try:
        folder, from_config = materialize(src, Path(config) if config else None, family, work)
        draft = export_pipeline(folder, out, options, progress=progress).to_dict()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    source = {**draft["source"], "path": src.name, "single_file": True}
    if from_config:  # weights that are not the checkpoint's: say whose they are
        source["from_config"] = from_config
    draft["source"] = source
    write_manifest(out, draft)  # the manifest is not among the hashed files
    return typed(draft, str(out))
