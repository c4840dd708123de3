"""A diffusers AutoencoderTiny folder (TAESD) -> a model folder's vae_decoder_tiny / vae_encoder_tiny.

`export SRC OUT --tiny-vae DIR` adds it to a new export; `add_tiny_vae` adds it to an exported folder
(the other components' files stay as they are). The folder is checked against the pipeline before
torch loads anything: an AutoencoderTiny, the VAE's latent channels and spatial factor.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from ..errors import UserError
from ..families import Family, get_family
from ..families.tiny_vae import CLASS, DECODER, ENCODER, tiny_vae_specs

TINY_NAMES = (DECODER, ENCODER)


def _number(cfg: dict, key: str, default: float, where: str) -> float:
    v = cfg.get(key, default)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(f"{where}: {key} must be a finite number, got {v!r}")
    return float(v)


def _blocks(cfg: dict, key: str, where: str) -> int:
    v = cfg.get(key, (64, 64, 64, 64))  # AutoencoderTiny's default: TAESD, 8x
    if not isinstance(v, (list, tuple)) or not v:
        raise UserError(f"{where}: {key} must be a non-empty list, got {v!r}")
    return len(v)


def check_tiny_source(tiny: Path | str, family: Family, info: dict) -> dict:
    """The tiny autoencoder's config.json, checked against the pipeline it joins; one line on any problem."""
    tiny = Path(tiny)
    if not family.tiny_vae:
        raise UserError(f"a {family.name} pipeline's VAE has no tiny ({CLASS}) stand-in here")
    path = tiny / "config.json"
    if not tiny.is_dir() or not path.is_file():
        raise UserError(f"--tiny-vae {tiny} is not a diffusers {CLASS} folder (no config.json)")
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(cfg, dict) or cfg.get("_class_name") != CLASS:
        got = cfg.get("_class_name") if isinstance(cfg, dict) else type(cfg).__name__
        raise UserError(f"{path}: a tiny VAE must be {CLASS}, got {got!r}")
    where = str(path)
    channels = cfg.get("latent_channels", 4)
    if channels != int(info.latent_channels):
        raise UserError(f"{where}: latent_channels {channels!r} is not the VAE's {info.latent_channels}")
    up = cfg.get("upsampling_scaling_factor", 2)
    if isinstance(up, bool) or not isinstance(up, int) or up < 1:
        raise UserError(f"{where}: upsampling_scaling_factor must be a positive integer, got {up!r}")
    f = int(info.vae_scale_factor)
    dec = up ** (_blocks(cfg, "decoder_block_out_channels", where) - 1)
    enc = 2 ** (_blocks(cfg, "encoder_block_out_channels", where) - 1)
    if dec != f or enc != f:
        raise UserError(f"{where}: it scales images by {dec}x (decoder) / {enc}x (encoder); the VAE's factor is {f}")
    if _number(cfg, "scaling_factor", 1.0, where) <= 0:
        raise UserError(f"{where}: scaling_factor must be positive")
    _number(cfg, "shift_factor", 0.0, where)
    return cfg


def export_tiny(tiny: Path | str, cfg: dict, family: Family, info: dict, dest: Path, options,
                names: tuple[str, ...] = TINY_NAMES) -> dict[str, dict]:
    """Export (and validate) the tiny autoencoder's halves `names` under dest/<name>/; their manifest entries."""
    import torch
    from diffusers import AutoencoderTiny

    from . import family_export
    from .validate import export_component, free_memory

    tiny = Path(tiny)
    try:
        module = AutoencoderTiny.from_pretrained(tiny, local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {tiny}: {first}") from None
    scaling = _number(cfg, "scaling_factor", 1.0, str(tiny))
    shift = _number(cfg, "shift_factor", 0.0, str(tiny))
    entries = {}
    for name, spec in tiny_vae_specs(int(info.latent_channels)).items():
        if name not in names:
            continue
        dims = family.export_dims(spec, info)
        gen = torch.Generator().manual_seed(0)
        feeds = [family_export.export_feeds(family, spec, d, gen, 0) for d in dims]
        entry = export_component(spec, family_export.wrap(family, spec, module), feeds, dest / name, options)
        entry.update(family=family.name, shapes_validated=dims, scaling_factor=scaling, shift_factor=shift)
        shutil.copy2(tiny / "config.json", dest / name / "config.json")
        entries[name] = entry
    del module
    free_memory()
    return entries


def add_tiny_vae(folder: Path | str, tiny: Path | str, out: Path | str | None = None, overwrite: bool = False,
                 names: tuple[str, ...] = TINY_NAMES, options=None) -> dict:
    """Add (or replace) an exported folder's tiny autoencoder: `out` (default: `folder`, in place) gets
    `names` exported from the diffusers AutoencoderTiny folder `tiny`; every other file is linked as it
    was. Returns the new manifest."""
    from ..folder.artifacts import derive, read_manifest, verify_folder
    from .options import ExportOptions

    folder = Path(folder)
    unknown = [n for n in names if n not in TINY_NAMES]
    if unknown or not names:
        raise UserError(f"tiny VAE components are {DECODER} and {ENCODER}, got {list(names)}")
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)
    family = get_family(manifest.family)
    info = manifest.pipeline
    cfg = check_tiny_source(tiny, family, info)
    in_place = out is None or Path(out).resolve() == folder.resolve()
    target = folder if in_place else Path(out)
    with derive(folder, target, manifest, replace=TINY_NAMES, overwrite=overwrite, in_place=in_place) as d:
        for name in TINY_NAMES:
            d.components.pop(name, None)
        d.components.update(export_tiny(tiny, cfg, family, info, d.tmp, options or ExportOptions(), names))
    return read_manifest(target)
