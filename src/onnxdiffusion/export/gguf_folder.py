"""`export MODEL.gguf OUT --base EXPORTED`: --base an onnxdiffusion model folder (an fp32 export of the same model
kind) instead of a diffusers folder. Its text encoders, VAE, tokenizers and scheduler are copied as they are; only
the backbone is exported, from the GGUF file, against the backbone config.json export kept beside the backbone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import UserError
from ..folder.artifacts import MANIFEST, atomic_dir, hash_tree, read_json_object, read_manifest, write_manifest
from ..folder.manifest import Manifest, typed


def is_model_folder(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _check_base(base: Path):
    from ..families import get_family
    from ..families.base import class_of

    manifest = read_manifest(base)
    family = get_family(manifest.family)
    entry = manifest.components.get(family.backbone)
    draft = manifest.to_dict()
    raw = draft["components"].get(family.backbone) or {}
    if entry is None or (entry.precision or "fp32") != "fp32" or raw.get("quantized_from") or draft.get("controlnets"):
        raise UserError(f"--base {base}: an exported folder as --base must be a plain fp32 export (its backbone is "
                        f"replaced; quantized, ControlNet or other derived folders hold records of the old one)")
    config = base / family.backbone / "config.json"
    class_name = class_of(read_json_object(base / "model_index.json"), family.backbone)
    if not config.is_file() or class_name is None:
        raise UserError(f"--base {base}: no {family.backbone}/config.json or model_index.json entry for the backbone "
                        f"(export keeps both)")
    return manifest, family, class_name


def export_into_folder(gguf_path: Path, out: Path, options, base: Path) -> Manifest:
    """The GGUF backbone exported into a copy of the exported folder `base`; returns the new manifest."""
    import time

    import torch

    from . import family_export
    from .attention import DOMAIN_OP, fuse_attention
    from .gguf_backbone import build_backbone, check_file, precision_label
    from .gguf_file import read_gguf
    from .streamed_backbone import cut_validation, export_streamed
    from .validate import export_component

    manifest, family, class_name = _check_base(base)
    gg = read_gguf(gguf_path)
    check_file(gg, family)
    info = manifest.pipeline
    spec = family.component_specs(info, {family.backbone, "vae"})[family.backbone]
    t0 = time.time()
    with atomic_dir(out, overwrite=options.overwrite, inputs=(gguf_path, base)) as tmp:
        for p in base.iterdir():
            if p.name not in (MANIFEST, family.backbone):
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp / p.name)
        module, report = build_backbone(gg, family, class_name, base / family.backbone, options.gguf_layout)
        fused = fuse_attention(module) if options.fuse_attention else 0
        dims = family.export_dims(spec, info)
        gen = torch.Generator().manual_seed(0)
        feeds = [family_export.export_feeds(family, spec, d, gen, 0) for d in dims]
        if cut_validation(module, options.stream_weights):
            entry = export_streamed(spec, module, lambda m: family_export.wrap(family, spec, m).eval(), feeds,
                                    tmp / family.backbone, options)
        else:
            wrapped = family_export.wrap(family, spec, module).eval()
            module = None
            entry = export_component(spec, wrapped, feeds, tmp / family.backbone, options)
        module = wrapped = None
        shutil.copy2(base / family.backbone / "config.json", tmp / family.backbone / "config.json")
        entry.update(family=family.name, shapes_validated=dims, precision=precision_label(report), gguf=report)
        draft = manifest.to_dict()
        draft["components"][family.backbone] = entry
        modules = {k: v for k, v in (draft.get("attention") or {}).get("modules", {}).items() if k != family.backbone}
        if fused:
            modules[family.backbone] = fused
        draft["attention"] = {"fused": True, "op": DOMAIN_OP.replace("::", "."), "modules": modules} if modules \
            else {"fused": False}
        draft["source"] = {**draft["source"], "path": gguf_path.name, "gguf": True, "base_folder": base.name}
        draft["export_seconds"] = round(time.time() - t0, 2)
        draft["files"] = hash_tree(tmp)
        write_manifest(tmp, draft)
    return typed(draft, str(out))
