"""`lora points`: derive a model folder whose backbone and text encoders carry LoRA insertion points.

Works on any exported folder, fp32 or quantized (points.py reads ORT's fused integer kernels), so
it runs at export (`export --lora-points`) and on folders that already exist. Unchanged files are
linked; external weight files stay where they are (the rewritten graph keeps its references).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..folder.artifacts import MANIFEST, atomic_dir, hash_tree, link_files, read_manifest, verify_folder, write_manifest
from ..errors import UserError
from ..families import get_family
from ..folder.manifest import Component, Manifest, confined, typed
from .points import SCOPES, insert_points

LORA_VERSION = 1


def lora_components(family_name: str, comps: Mapping[str, Component]) -> list[str]:
    """The components LoRAs reach: the backbone (and a precision schedule's second one) and text encoders."""
    family = get_family(family_name)
    names = [n for n in [family.backbone] + [s.name for s in family.text_encoders] if n in comps]
    backbone = comps.get(family.backbone)
    high = backbone.precision_schedule.component if backbone and backbone.precision_schedule else None
    if high in comps:
        names.append(high)
    return names


def rewrite_component(folder: Path, entry: Component, out_path: Path, scope: str) -> dict:
    """Rewrite one component's graph into `out_path`; returns its manifest `lora` entry."""
    import onnx

    from ..onnxio import fp16_storage
    from ..onnxio.files import write

    src = confined(folder, entry.path, "component")
    try:
        model = onnx.load(str(src), load_external_data=False)
    except Exception as e:  # protobuf decode errors have no common public type
        raise UserError(f"cannot load {src}: not a valid ONNX file ({type(e).__name__})") from None
    fp16_storage.expand(model, str(src))
    try:
        targets = insert_points(model, scope)
    except ValueError as e:
        raise UserError(f"{src}: {e}") from None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write(model, out_path)
    return {"version": LORA_VERSION, "scope": scope, "targets": {m: t.to_dict() for m, t in targets.items()}}


def add_points(model: Path | str, out: Path | str, scope: str = "linear", overwrite: bool = False,
               verify: bool = True) -> Manifest:
    """A copy of `model` with LoRA insertion points; returns the new manifest."""
    model, out = Path(model), Path(out)
    if scope not in SCOPES:
        raise UserError(f"--scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    manifest = read_manifest(model)
    if verify:
        verify_folder(model, manifest)
    comps = manifest.components
    names = lora_components(manifest.family, comps)
    if any(comps[n].lora for n in names):
        raise UserError(f"{model} already has LoRA insertion points")
    rewritten = {comps[n].path for n in names}
    draft = manifest.to_dict()
    with atomic_dir(out, overwrite=overwrite, inputs=(model,)) as tmp:
        link_files(model, tmp, [rel for rel in manifest.files if rel not in rewritten and rel != MANIFEST])
        for name in names:
            dest = confined(tmp, comps[name].path, name)
            draft["components"][name]["lora"] = rewrite_component(model, comps[name], dest, scope)
            draft["components"][name]["bytes"] = dest.stat().st_size
        draft["files"] = hash_tree(tmp)
        write_manifest(tmp, draft)
    return typed(draft, str(out))


def has_points(manifest) -> bool:
    return any(entry.lora for entry in manifest.components.values())


def cache_root() -> Path:
    """Where derived folders live: $ONNXDIFFUSION_CACHE, else $XDG_CACHE_HOME/onnxdiffusion, else ~/.cache/onnxdiffusion."""
    import os

    env = os.environ.get("ONNXDIFFUSION_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onnxdiffusion"


def with_points(model: Path | str, log=print, scope: str = "all") -> Path:
    """`model` if it has LoRA insertion points, else its copy with them (`lora points --scope all`, so an adapter
    reaching k x k convs fits too), derived once and kept under cache_root() by the folder's content: its
    manifest's file hashes, which loading verifies. A plain export then takes a LoRA without a `lora points` step;
    the points add exact zeros without an adapter, so its plain image is unchanged."""
    import hashlib
    import json

    model = Path(model)
    manifest = read_manifest(model)
    if has_points(manifest):
        return model
    digest = hashlib.sha256(json.dumps({"files": dict(manifest.files), "scope": scope, "version": LORA_VERSION},
                                       sort_keys=True).encode()).hexdigest()[:20]
    out = cache_root() / "lora-points" / digest
    if (out / MANIFEST).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"{model}: no LoRA insertion points; deriving a copy with them once (cached by content in {out})")
    try:
        add_points(model, out, scope=scope)
    except UserError:
        if (out / MANIFEST).is_file():  # another process derived the same copy meanwhile
            return out
        raise
    return out
