"""Backbone names as the quantize recipes spell them (imports nothing: the recipe configs read it).

Recipes have always called the backbone "unet" whatever the family, and the manifests of quantized
folders record their recipe's dict, so that spelling stays the stored one. On the command line the
backbone may also be named "backbone" or by its family's own component name.
"""

from __future__ import annotations

RECIPE_BACKBONE = "unet"
BACKBONE_ALIASES = ("backbone", "unet", "transformer")


def backbone_key(name: str) -> str:
    """RECIPE_BACKBONE for any of the backbone's names, else `name`."""
    return RECIPE_BACKBONE if name in BACKBONE_ALIASES else name
