"""Model families: one declarative module per model kind (see base.py for the protocol).

Everything outside this package asks the family; nothing else branches on a model class name.
"""

from __future__ import annotations

from ..errors import UserError
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, NumpyOps, Ops, TensorSpec, TextEncoderSlot
from .flux import Flux
from .qwenimage import QwenImage
from .qwenimage_edit import QwenImageEdit
from .sd import StableDiffusion
from .sd3 import StableDiffusion3
from .sdxl import StableDiffusionXL

_FAMILIES: dict[str, Family] = {}
DEFAULT = "sd"  # folders exported before families were recorded


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


register(StableDiffusion())
register(StableDiffusionXL())
register(StableDiffusion3())
register(Flux())
register(QwenImage())
register(QwenImageEdit())


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_family(name: str | None) -> Family:
    """The family a manifest names (absent: Stable Diffusion, what every older folder holds)."""
    name = DEFAULT if name is None else name
    if name not in _FAMILIES:
        raise UserError(f"unknown model family {name!r}; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def family_for_pipeline(class_name: str | None) -> Family:
    """The family whose diffusers pipeline class this is."""
    for family in _FAMILIES.values():
        if class_name in family.pipeline_classes:
            return family
    known = ", ".join(c for f in _FAMILIES.values() for c in f.pipeline_classes)
    raise UserError(f"unsupported pipeline class {class_name!r}; supported: {known}")


__all__ = [
    "CONTEXT", "OUT", "SAMPLE", "TIMESTEP", "ComponentSpec", "Family", "NumpyOps", "Ops", "TensorSpec",
    "TextEncoderSlot", "family_for_pipeline", "get_family", "names", "register",
]
