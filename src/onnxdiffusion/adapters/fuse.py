"""Fused LoRA (`export SRC OUT --lora FILE[:SCALE]`): the LoRAs merged into the torch weights before export,
W' = W + sum_i w_i s_i up_i @ down_i, the arithmetic of diffusers' `fuse_lora`, so `quantize` calibrates
the model people will run. Export side (torch)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import UserError
from .feeds import LoraCache, normalize
from .lora_file import LoraLayers


def check_loras(loras, components: set[str]) -> list[dict]:
    """Read every file before torch loads anything; returns their manifest records."""
    cache, records = LoraCache(), []
    for path, weight in normalize(loras):
        layers = cache.get(path)
        for comp, modules in layers.items():
            if comp not in components:
                raise UserError(f"{path}: key {comp}.{next(iter(modules))}: the pipeline has no component {comp!r} "
                                f"(have {', '.join(sorted(components))})")
        records.append({"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "scale": weight,
                        "layers": sum(len(m) for m in layers.values()), "_layers": layers, "_path": str(path)})
    return records


def fuse_into(module, component: str, records: list[dict]) -> int:
    """Merge every record's layers of `component` into the torch `module`; returns the layers changed."""
    import torch

    n = 0
    for rec in records:
        layers: LoraLayers = rec["_layers"]
        for name, layer in layers.get(component, {}).items():
            try:
                target = module.get_submodule(name)
            except AttributeError:
                raise UserError(f"{rec['_path']}: unknown key {component}.{name}: the model's {component} has no "
                                f"such module (a LoRA for another model?)") from None
            weight = getattr(target, "weight", None)
            down, up = torch.from_numpy(layer.down.copy()), torch.from_numpy(layer.up.copy())
            if weight is None or weight.ndim not in (2, 4):
                raise UserError(f"{rec['_path']}: {component}.{name} is not a Linear or Conv2d layer")
            delta_shape = (up.shape[0], *down.shape[1:])
            if up.ndim != down.ndim and weight.ndim == 4:
                down, up = down.reshape(*down.shape[:2], 1, 1), up.reshape(*up.shape[:2], 1, 1)
            delta = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape[0], *down.shape[1:]) \
                if up.shape[0] == weight.shape[0] and down.flatten(1).shape[1] == weight[0].numel() else None
            if delta is None:
                raise UserError(f"{rec['_path']}: {component}.{name}: LoRA shapes {list(layer.down.shape)} / "
                                f"{list(layer.up.shape)} do not fit the layer's weight {list(weight.shape)} "
                                f"(delta {list(delta_shape)}): a LoRA for another model?")
            with torch.no_grad():
                weight += (rec["scale"] * layer.scale) * delta.reshape(weight.shape).to(weight.dtype)
            n += 1
    return n


def manifest_records(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
