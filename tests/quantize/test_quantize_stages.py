"""Recipes declare what quantize must prepare for them (typed class attributes and properties, no
isinstance/getattr probing); int8 variants are int8 settings plus their own fields; `-O components=`
takes `backbone`; dicts stored by older versions still read; Built's typed fields reach the report."""

import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import (RECIPES, Fp8Recipe, Fp16Recipe, Int8NaiveRecipe, Int8StaticRecipe, Int8TimestepRecipe,
                                    MixedRecipe, Nvfp4Recipe, recipe_class, recipe_from_dict)
from onnxdiffusion.quantize.configs import BACKBONE
from onnxdiffusion.quantize.recipes import BUILDERS, Built


def test_every_registered_recipe_has_a_builder_and_round_trips():
    assert set(BUILDERS) == set(RECIPES.values())
    for cls in RECIPES.values():
        r = cls()
        assert recipe_from_dict(r.to_dict()) == r


def test_recipes_declare_what_they_need():
    assert Int8NaiveRecipe.random_calibration and not Int8NaiveRecipe.calibrated
    assert Int8StaticRecipe.calibrated and Int8TimestepRecipe.calibrated and MixedRecipe.calibrated
    assert all(RECIPES[n].takes_skeleton for n in ("fp16", "int8-dynamic", "int8-static", "int4-weights", "mixed"))
    assert not Fp8Recipe.takes_skeleton and not Nvfp4Recipe.takes_skeleton
    assert MixedRecipe().searches and MixedRecipe(probe_prompts=5).probe_count == 5
    assert Fp8Recipe().searches and not Fp8Recipe(keep_16bit="none").searches
    assert not Nvfp4Recipe(activations="fp4", form="tensorrt").searches and Int8StaticRecipe().probe_count == 8
    assert Fp16Recipe(components=("vae_decoder",)).targets == ("vae_decoder",)
    assert not Fp16Recipe(components=("vae_decoder",)).quantizes_backbone and Int8NaiveRecipe().quantizes_backbone


@pytest.mark.parametrize("alias", ["backbone", "unet", "transformer"])
def test_components_option_takes_the_backbone_by_any_of_its_names(alias):
    r = recipe_class("int8-static").with_options({"components": f"{alias},vae_decoder"})
    assert r.targets == (BACKBONE, "vae_decoder") and r.to_dict()["components"] == [BACKBONE, "vae_decoder"]
    assert recipe_class("fp16").with_options({"components": alias}).targets == (BACKBONE,)


def test_int8_variants_compose_the_settings_instead_of_forbidding_static_fields():
    for cls in (Int8NaiveRecipe, Int8TimestepRecipe, MixedRecipe):
        assert not issubclass(cls, Int8StaticRecipe)
        fields = cls().to_dict()
        assert "bias_correction" not in fields and "components" not in fields and "kernels" not in fields and fields["version"] == 8
        with pytest.raises(UserError, match="unknown option"):
            cls.with_options({"bias_correction": "1"})


def test_dicts_of_the_subclass_era_still_read():
    old = {"name": "int8-naive", "version": 6, "components": ["unet"], "components_keep_float": ["*conv_out*"],
           "bias_correction": 0, "samples": 8}
    assert recipe_from_dict(old) == Int8NaiveRecipe(samples=8)
    assert recipe_from_dict({"name": "mixed", "version": 2}).attention == "float"  # int8-static's v2 legacy
    with pytest.raises(UserError, match="retired"):
        recipe_from_dict({**old, "bias_correction": 1})


def test_built_typed_fields_reach_the_report_details():
    b = Built({BACKBONE: onnx.ModelProto()}, "x", details={"calibrated_tensors": 3}, stored_as="QDQ",
              timestep_groups={"boundaries": [500.0], "groups": [{"steps": [0]}, {"steps": [1]}]}, simulated_on_cpu=True)
    d = b.report_details()
    assert d["stored_as"] == "QDQ" and d["boundaries"] == [500.0] and d["simulated_on_cpu"] is True
    assert d["calibrated_tensors"] == 3 and "requires_provider" not in d and b.backbone is not None
