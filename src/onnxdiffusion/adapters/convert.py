"""`lora convert`: any LoRA diffusers reads (kohya/A1111 included) -> the file the run time reads without torch.

Export side: diffusers' own `lora_state_dict` (with its kohya converters and, for SDXL, the UNet
config that maps sgm block numbers) turns the file into diffusers keys; its peft converters name
the layers as the model's modules; the scales (alpha / r, diffusers' rules) are folded into the
up matrices, and the result is written as `<component>.<module>.lora_A/B.weight` with
`__metadata__.format = onnxdiffusion-lora`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import safetensors_io
from .lora_file import FORMAT, _PAIRS, is_kohya, layers_from_tensors


def _pipeline_class(model: Path | None):
    import diffusers

    from ..folder.artifacts import read_manifest

    if model is None:
        return diffusers.StableDiffusionPipeline, None
    manifest = read_manifest(Path(model))
    cls = getattr(diffusers, str(manifest.source_class or ""), None)
    if cls is None or not hasattr(cls, "lora_state_dict"):
        raise UserError(f"{model}: its pipeline class {manifest.source_class!r} has no LoRA loader in diffusers")
    from ..families import get_family

    cfg = Path(model) / get_family(manifest.family).backbone / "config.json"
    return cls, (json.loads(cfg.read_text()) if cfg.is_file() else None)


def _renames(sd: dict) -> dict[str, str]:
    """Old diffusers key -> peft key (`to_q_lora.down` -> `q_proj.lora_A`, ...), per component; keys diffusers'
    converters do not recognise (the UNet's `.lora.down`, which lora_file reads) stay as they are."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, convert_unet_state_dict_to_peft

    groups: dict[str, dict] = {}
    for k, v in sd.items():
        groups.setdefault(k.split(".", 1)[0], {})[k] = v
    names = {}
    for comp, group in groups.items():
        try:  # a text encoder's attention-processor names differ from a backbone's (diffusers' two converters)
            converted = list(convert_state_dict_to_peft(convert_state_dict_to_diffusers(dict(group)))
                             if comp.startswith("text_encoder") else convert_unet_state_dict_to_peft(dict(group)))
        except ValueError:
            converted = list(group)
        if len(converted) != len(group):
            converted = list(group)
        names.update(zip(group, converted))
    return names


def diffusers_tensors(src: Path, model: Path | None) -> dict[str, np.ndarray]:
    """The LoRA as diffusers/peft keys (numpy), alphas as `<component>.<module>.alpha`."""
    import inspect

    import torch

    tensors, _ = safetensors_io.read(src)
    cls, unet_config = _pipeline_class(model)
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
    kwargs = {"unet_config": unet_config} if unet_config and "unet_config" in inspect.signature(cls.lora_state_dict).parameters else {}
    try:
        out = cls.lora_state_dict(state, return_alphas=True, **kwargs) if "return_alphas" in \
            inspect.signature(cls.lora_state_dict).parameters else cls.lora_state_dict(state, **kwargs)
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"{src}: diffusers cannot read this LoRA: {str(e).strip().splitlines()[0][:200]}") from None
    sd, alphas = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    names = _renames(sd)
    result = {names[k]: v.float().numpy() for k, v in sd.items()}
    for key, alpha in (alphas or {}).items():
        base = key[:-len(".alpha")]
        down = base if base in sd else next((base + a for a, _ in _PAIRS if base + a in sd), None)
        module = base
        if down is not None:
            new = names[down]
            module = next((new[:-len(a)] for a, _ in _PAIRS if new.endswith(a)), new)
        result[module + ".alpha"] = np.asarray([float(alpha)], np.float32)
    return result


def convert_lora(src: Path | str, out: Path | str, model: Path | str | None = None, overwrite: bool = False) -> int:
    """Write the converted file; returns the number of layers."""
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise UserError(f"output directory does not exist: {out.parent}")
    tensors, meta = safetensors_io.read(src)
    if is_kohya(tensors):
        try:
            tensors, meta = diffusers_tensors(src, Path(model) if model else None), {}
        except ImportError as e:
            raise UserError(f"converting a kohya LoRA needs the export extra (pip install 'onnxdiffusion[export]'): {e}") from None
    layers = layers_from_tensors(src, tensors, meta)
    flat: dict[str, np.ndarray] = {}
    for comp, modules in layers.items():
        for module, layer in modules.items():
            flat[f"{comp}.{module}.lora_A.weight"] = layer.down
            flat[f"{comp}.{module}.lora_B.weight"] = (layer.up * np.float32(layer.scale)).astype(np.float32)
    safetensors_io.write(out, flat, {"format": FORMAT, "source": src.name})
    return sum(len(m) for m in layers.values())
