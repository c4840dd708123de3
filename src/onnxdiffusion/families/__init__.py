"""Model families: one declarative module per model kind (see base.py for the protocol).

Everything outside this package asks the family; nothing else branches on a model class name.
"""

from __future__ import annotations

from ..errors import UserError
from .graph_ends import NumpyOps, Ops
from .base import CONTEXT, OUT, SAMPLE, TIMESTEP, ComponentSpec, Family, TensorSpec, TextEncoderSlot
from .flux import Flux
from .flux2 import Flux2Dev, Flux2Klein
from .flux_kontext import FluxKontext
from .qwenimage import QwenImage
from .qwenimage_edit import QwenImageEdit
from .sd import StableDiffusion
from .sd3 import StableDiffusion3
from .sdxl import StableDiffusionXL
from .zimage import ZImage

_FAMILIES: dict[str, Family] = {}
DEFAULT = "sd"  # folders exported before families were recorded


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


register(StableDiffusion())
register(StableDiffusionXL())
register(StableDiffusion3())
register(Flux())
register(FluxKontext())
register(QwenImage())
register(QwenImageEdit())
register(ZImage())
register(Flux2Klein())
register(Flux2Dev())


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_family(name: str | None) -> Family:
    """The family a manifest names (absent: Stable Diffusion, what every older folder holds)."""
    name = DEFAULT if name is None else name
    if name not in _FAMILIES:
        raise UserError(f"unknown model family {name!r}; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def image_roles() -> dict[str, tuple[str, ...]]:
    """What `image` means, by role ("start": img2img, "reference": editing, "none"), -> the families of that role."""
    roles: dict[str, tuple[str, ...]] = {}
    for family in _FAMILIES.values():
        roles[family.image_role] = (*roles.get(family.image_role, ()), family.name)
    return roles


def describe_image_roles() -> str:
    """One line for --help and the API schema: which families edit and which do img2img."""
    roles = image_roles()
    parts = [f"the picture to edit for {', '.join(roles['reference'])} (editing by instruction)"] if "reference" in roles else []
    optional = [f.name for f in _FAMILIES.values() if f.image_role == "reference" and f.references_optional]
    parts += [f"optional for {', '.join(optional)}, which take several and draw from text alone without"] if optional else []
    parts += [f"the img2img start picture for {', '.join(roles['start'])}"] if "start" in roles else []
    parts += [f"refused by {', '.join(roles['none'])}"] if "none" in roles else []
    return "; ".join(parts)


def family_for_pipeline(class_name: str | None) -> Family:
    """The family whose diffusers pipeline class this is."""
    for family in _FAMILIES.values():
        if class_name in family.pipeline_classes:
            return family
    known = ", ".join(c for f in _FAMILIES.values() for c in f.pipeline_classes)
    raise UserError(f"unsupported pipeline class {class_name!r}; supported: {known}")


__all__ = [
    "CONTEXT", "OUT", "SAMPLE", "TIMESTEP", "ComponentSpec", "Family", "NumpyOps", "Ops", "TensorSpec",
    "TextEncoderSlot", "describe_image_roles", "family_for_pipeline", "get_family", "image_roles", "names", "register",
]
