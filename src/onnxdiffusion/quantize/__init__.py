"""Quantization: typed recipes, one `quantize` verb (see configs.py for the recipes).

Importing this package is cheap and pulls in neither onnx nor ONNX Runtime's quantization tools
(the run-time remedies live in techniques/); `quantize` loads them on first call.
"""

from __future__ import annotations

from .configs import (
    RECIPES,
    CalibrationConfig,
    Fp8Recipe,
    Fp16Recipe,
    Int4WeightsRecipe,
    Int8DynamicRecipe,
    Int8NaiveRecipe,
    Int8StaticRecipe,
    Int8TimestepRecipe,
    MixedRecipe,
    Nvfp4Recipe,
    QuantizeConfig,
    Recipe,
    recipe_class,
    recipe_from_dict,
)


def quantize(model, out, config: QuantizeConfig, **kwargs) -> dict:
    """See `onnxdiffusion.quantize.api.quantize`."""
    from .api import quantize as _quantize

    return _quantize(model, out, config, **kwargs)


__all__ = [
    "RECIPES", "CalibrationConfig", "Fp8Recipe", "Fp16Recipe", "Int4WeightsRecipe", "Int8DynamicRecipe", "Int8NaiveRecipe",
    "Int8StaticRecipe", "Int8TimestepRecipe", "MixedRecipe", "Nvfp4Recipe", "QuantizeConfig", "Recipe", "quantize",
    "recipe_class", "recipe_from_dict",
]
