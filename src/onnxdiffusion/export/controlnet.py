"""A diffusers ControlNet folder -> a model folder's controlnets/NAME/model.onnx.

`export SRC OUT --controlnet NAME=DIR` adds ControlNets to a new export; `add_controlnet` adds one to an
exported folder (every other file stays as it is). The ControlNet's config is checked against the folder's
backbone by its family before torch loads anything (another family or size: one line, nothing written).
The manifest records each under `controlnets` (not `components`: tools that rewrite every component,
quantize and relayout, leave them alone), with what a load-time check needs.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..folder.artifacts import read_json_object
from ..errors import UserError
from ..families import Family, get_family

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
WEIGHTS = "diffusion_pytorch_model.safetensors"


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or name.endswith(".onnx"):
        raise UserError(f"ControlNet name {name!r}: use 1-64 letters, digits, '_', '-', '.' (starting with a letter or digit)")
    return name


def parse_pairs(values) -> list[tuple[str, str]]:
    """`--controlnet NAME=DIR` values -> [(name, dir)], names unique."""
    pairs = []
    for v in values or ():
        name, sep, path = str(v).partition("=")
        if not sep or not path:
            raise UserError(f"--controlnet expects NAME=DIR, got {v!r}")
        pairs.append((check_name(name), path))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise UserError(f"--controlnet names must be distinct, got {names}")
    return pairs


def check_source(cn_dir: Path | str, family: Family, info: dict, backbone_config: dict) -> dict:
    """The ControlNet folder's record for this folder's backbone (config checked, safetensors weights there)."""
    cn_dir = Path(cn_dir)
    if not (cn_dir / "config.json").is_file():
        raise UserError(f"{cn_dir} is not a diffusers ControlNet folder (no config.json)")
    if not (cn_dir / WEIGHTS).is_file():
        raise UserError(f"{cn_dir}: no {WEIGHTS} (only safetensors weights are read)")
    config = read_json_object(cn_dir / "config.json")
    return family.controlnet_record(config, backbone_config, info)


def backbone_source(record: dict, backbone_dir, family: Family, config: dict) -> Path | None:
    """A net that borrows the backbone's layers (record `shares_backbone`: Z-Image's) needs the diffusers backbone
    it was made for: `backbone_dir` (a pipeline folder or its backbone subfolder), its config the folder's
    backbone's. None for a standalone net."""
    if not record.get("shares_backbone"):
        return None
    if backbone_dir is None:
        raise UserError(f"a {record['class']} borrows the {family.backbone}'s embedders and refiners: give the diffusers "
                        f"folder the model was exported from (--backbone DIR)")
    d = Path(backbone_dir)
    d = d / family.backbone if (d / family.backbone / "config.json").is_file() else d
    if not (d / "config.json").is_file():
        raise UserError(f"{backbone_dir} is not a diffusers pipeline folder or {family.backbone} folder (no config.json)")
    theirs = read_json_object(d / "config.json")

    def own(c: dict) -> dict:  # the architecture, without diffusers' bookkeeping keys
        return {k: v for k, v in c.items() if not k.startswith("_")}

    if theirs.get("_class_name") not in family.backbone_classes or own(theirs) != own(config):
        raise UserError(f"{d}'s config is not the model folder's {family.backbone} (another model's weights?)")
    return d


def _load_backbone(path: Path | None):
    if path is None:
        return None
    cls = _class(read_json_object(path / "config.json")["_class_name"])
    try:
        return cls.from_pretrained(path, local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {path}: {first}") from None


def export_controlnet(name: str, cn_dir: Path | str, record: dict, family: Family, info: dict, dest: Path,
                      options, backbone: Path | None = None) -> dict:
    """Export (validate against torch, store exact-fp16 weights as fp16) under dest/controlnets/NAME/; its draft.
    `backbone`: the diffusers backbone folder a net that borrows its layers needs (`backbone_source`)."""
    import shutil

    import onnx
    import torch

    from ..onnxio import fp16_storage
    from ..onnxio.files import write
    from . import family_export
    from .validate import export_component, free_memory

    cn_dir = Path(cn_dir)
    cls = _class(record["class"])
    try:
        module = cls.from_pretrained(cn_dir, local_files_only=True, use_safetensors=True).eval()
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {cn_dir}: {first}") from None
    shared = _load_backbone(backbone)
    spec = family.controlnet_spec(info, record)
    folder = dest / "controlnets" / name
    dims = family.export_dims(family.backbone_spec(info), info)
    gen = torch.Generator().manual_seed(0)
    feeds = []
    for d in dims:
        f = family_export.export_feeds(family, spec, d, gen, 0)
        f["controlnet_cond"] = torch.rand(*f["controlnet_cond"].shape, generator=gen)
        f["conditioning_scale"] = torch.tensor([0.7])
        feeds.append(f)
    wrap = _wrapper(record["class"])
    torch_net = wrap(module, shared) if shared is not None else wrap(module, [t.name for t in spec.inputs][2:-2])
    draft = export_component(spec, torch_net, feeds, folder, options)
    del module, shared, torch_net
    free_memory()
    path = folder / "model.onnx"
    if not draft["external_data"]:
        model = onnx.load(str(path))
        if stored := fp16_storage.store(model):
            write(model, path)
            draft["storage"] = {"fp16_tensors": stored}
        draft["bytes"] = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    shutil.copy2(cn_dir / "config.json", folder / "config.json")
    draft.update(record, path=f"controlnets/{name}/model.onnx",
                 external_data=[f"controlnets/{name}/{Path(f).name}" for f in draft["external_data"]],
                 shapes_validated=dims)
    return draft


def _class(name: str):
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        raise UserError(f"{name} is not available in this diffusers")
    return cls


def ControlNet(module, added: list[str]):  # noqa: N802 - a torch module made on demand (torch is export-only)
    """The ControlNet called with the ONNX inputs in order -> (down residuals..., mid residual)."""
    import torch

    class _ControlNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, sample, timestep, encoder_hidden_states, *rest):
            *more, cond, scale = rest
            kwargs = {"added_cond_kwargs": dict(zip(added[1:], more))} if len(added) > 1 else {}
            down, mid = self.model(sample, timestep, encoder_hidden_states, controlnet_cond=cond,
                                   conditioning_scale=scale, guess_mode=False, return_dict=False, **kwargs)
            return (*down, mid)

    return _ControlNet().eval()


def TokenControlNet(module, added: list[str]):  # noqa: N802
    """A transformer ControlNet (SD3ControlNetModel) called with the ONNX inputs in order -> its block samples.
    A net with force_zeros_for_pooled_projection is fed zero pooled projections, as its pipeline does."""
    import torch

    zero = bool(getattr(module.config, "force_zeros_for_pooled_projection", False))

    class _TokenControlNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, sample, timestep, encoder_hidden_states, pooled, cond, scale):
            samples = self.model(hidden_states=sample, controlnet_cond=cond, conditioning_scale=scale,
                                 encoder_hidden_states=encoder_hidden_states,
                                 pooled_projections=pooled * 0.0 if zero else pooled, timestep=timestep,
                                 return_dict=False)[0]
            return tuple(samples)

    return _TokenControlNet().eval()


def _wrapper(cls: str):
    """The torch wrapper that gives this ControlNet class the flat ONNX signature its family's spec names."""
    if cls == "FluxControlNetModel":
        from .flow_components import FluxControlNet

        return lambda module, added: FluxControlNet(module).eval()
    if cls == "ZImageControlNetModel":
        from .zimage_control import ZImageControlNet

        return lambda module, transformer: ZImageControlNet(module, transformer).eval()
    if cls == "QwenImageControlNetModel":
        from .flow_components import QwenImageControlNet

        return lambda module, added: QwenImageControlNet(module).eval()
    return TokenControlNet if cls == "SD3ControlNetModel" else ControlNet


def add_controlnet(folder: Path | str, cn_dir: Path | str, name: str, out: Path | str | None = None,
                   overwrite: bool = False, options=None, backbone: Path | str | None = None) -> dict:
    """Add ControlNet `name` (a diffusers ControlNet folder of the family's class) to an exported folder (in place by default);
    an existing one of that name only with `overwrite`. `backbone`: the diffusers folder the model was exported
    from, for a net that borrows the backbone's layers (Z-Image's). Returns the new manifest."""
    from ..folder.artifacts import derive, read_manifest, verify_folder
    from .options import ExportOptions

    folder = Path(folder)
    check_name(name)
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)
    family = get_family(manifest.family)
    info = manifest.pipeline
    have = manifest.controlnets or {}
    if name in have and not overwrite:
        raise UserError(f"{folder} already has a ControlNet named {name!r} (--overwrite replaces it)")
    own = backbone_config(folder, manifest, family)
    record = check_source(cn_dir, family, info, own)
    shared = backbone_source(record, backbone, family, own)
    in_place = out is None or Path(out).resolve() == folder.resolve()
    target = folder if in_place else Path(out)
    with derive(folder, target, manifest, overwrite=overwrite, in_place=in_place) as d:
        old = (d.draft.get("controlnets") or {}).get(name)
        if old is not None:  # the replaced net's files are not carried over
            for rel in [old["path"], *old.get("external_data", []), f"controlnets/{name}/config.json"]:
                d.path(rel).unlink(missing_ok=True)
        entry = export_controlnet(name, cn_dir, record, family, info, d.tmp, options or ExportOptions(), shared)
        d.draft.setdefault("controlnets", {})[name] = entry
    return read_manifest(target)


def backbone_config(folder: Path, manifest, family: Family) -> dict:
    """The backbone's diffusers config.json, which export copies beside its ONNX file."""
    from ..folder.artifacts import confined

    path = confined(folder, f"{family.backbone}/config.json", "backbone config")
    if not path.is_file():
        raise UserError(f"{folder}: {family.backbone}/config.json is missing (a folder exported by an older version?); "
                        "re-export it to add a ControlNet")
    return read_json_object(path)
