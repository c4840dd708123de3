"""`export CHECKPOINT.safetensors OUT --config DIR`: a single-file checkpoint (the A1111 / ComfyUI layout)
through diffusers' `from_single_file`, offline.

diffusers maps the original keys to its modules; what the checkpoint does not hold (component
configs, tokenizers, the scheduler) comes from `--config`, a local diffusers folder of the same model
kind (its weights are not read). The package ships no tokenizers (the repository's size budget), so
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

from ..artifacts import MANIFEST, check_output_folder, write_json
from ..errors import UserError
from ..families import family_for_pipeline, get_family

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")


def is_checkpoint_file(src: Path) -> bool:
    return Path(src).is_file()


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


def materialize(src: Path, config: Path | None, family: str | None, work: Path) -> Path:
    """The checkpoint as a diffusers folder under `work` (weights from the checkpoint, the rest from --config)."""
    check_checkpoint(src)
    if config is None:
        raise UserError(f"{src}: a single-file checkpoint needs --config DIR, a local diffusers folder of the same "
                        f"model kind (its configs and tokenizers are used, not its weights)")
    config = Path(config)
    class_name = _pipeline_class(config, family)
    import diffusers

    cls = getattr(diffusers, class_name, None)
    if cls is None or not hasattr(cls, "from_single_file"):
        raise UserError(f"{class_name} cannot load single-file checkpoints in this diffusers")
    try:
        pipe = cls.from_single_file(str(src), config=str(config), local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(f"{src}: diffusers could not read this checkpoint as a {class_name}: {first}") from None
    folder = work / "diffusers"
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def export_checkpoint(src: Path | str, out: Path | str, options=None, config: Path | str | None = None,
                      family: str | None = None, progress: bool = True) -> dict:
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
        folder = materialize(src, Path(config) if config else None, family, work)
        manifest = export_pipeline(folder, out, options, progress=progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    manifest["source"] = {**manifest["source"], "path": src.name, "single_file": True}
    write_json(out / MANIFEST, manifest)  # the manifest is not among the hashed files
    return manifest
