"""int8-static -O components=...: the VAE decoder and text encoder quantized beside the backbone
(quantize/components.py), recorded in the manifest, honoured by the pipeline; bad lists fail in one line."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class, recipe_from_dict
from onnxdiffusion.quantize.graphs import op_counts
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

CAL = CalibrationConfig(count=4, steps=4, batch=4)
GEN = dict(steps=4, guidance=4.0, seed=1)
FIXED = {"attention": "float", "softmax": "float", "norms": "float", "modulation": "int8"}  # no group search


def _recipe(**options):
    return recipe_class("int8-static").with_options({**FIXED, **options})


@pytest.fixture(scope="module")
def quantized(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("qc") / "int8-all"
    recipe = _recipe(components="unet,vae_decoder,text_encoder", components_keep_float="*conv_out*")
    report = quantize(tiny_onnx, out, QuantizeConfig(recipe=recipe, calibration=CAL, latency_runs=2, measure_memory=False))
    return out, report


def test_components_quantized_recorded_and_run(quantized, tiny_onnx):
    out, report = quantized
    manifest = json.loads((out / "manifest.json").read_text())
    recipe = recipe_from_dict(manifest["quantization"]["config"]["recipe"])
    assert recipe.components == ("unet", "vae_decoder", "text_encoder") and recipe.version == 8
    for name, op in (("vae_decoder", "QLinearConv"), ("text_encoder", "MatMulIntegerToFloat")):
        info = manifest["components"][name]
        assert info["precision"] == "int8-static"
        assert info["session_options"]["disabled_optimizers"]  # the pipeline leaves the layout rewrites off
        assert op_counts(onnx.load(str(out / info["path"])))[op] > 0
        assert report["sizes"][name]["ratio"] > 1.5, report["sizes"][name]  # tiny graphs: names and norms weigh
        assert name in report["latency"]
        details = report["details"]["components"][name]
        assert details["quantized_nodes"] > 0 and details["calibration_feeds"] == (4 if name == "vae_decoder" else 5)
        assert details["output_snr_db"] > 20, details
    # the kept pattern: the decoder's conv_out stays a float Conv
    assert any("conv_out" in n for n in report["details"]["components"]["vae_decoder"]["float_nodes"])
    vae = onnx.load(str(out / manifest["components"]["vae_decoder"]["path"]))
    assert op_counts(vae).get("Conv", 0) + op_counts(vae).get("FusedConv", 0) >= 1
    ref = Pipeline.from_folder(tiny_onnx)("a red circle", **GEN)
    got = Pipeline.from_folder(out)("a red circle", **GEN)  # hashes verified, sessions built with the options
    assert psnr(ref.images, got.images) > 15


def test_backbone_only_is_unchanged_by_default(tiny_onnx):
    r = recipe_class("int8-static")()
    assert r.components == ("unet",)
    old = {**r.to_dict(), "version": 4}
    del old["components"], old["components_keep_float"]
    assert recipe_from_dict(old) == r  # a version-4 manifest reads as the backbone only


@pytest.mark.parametrize("options,fragment", [
    ({"components": "vae_decoder"}, "must include the backbone"),
    ({"components": "unet,vae_encoder"}, "int8-static component must be one of"),
    ({"components": "unet,vae_decoder,vae_decoder"}, "listed twice"),
])
def test_bad_component_lists_are_one_line_errors(options, fragment):
    with pytest.raises(UserError, match=fragment) as e:
        _recipe(**options)
    assert "\n" not in str(e.value)


def test_only_int8_static_takes_components():
    # the other int8 recipes are int8 settings plus their own fields: components is not one of them
    with pytest.raises(UserError, match="unknown option 'components' for recipe int8-timestep"):
        recipe_class("int8-timestep").with_options({"components": "unet,vae_decoder"})


def test_missing_component_fails_before_anything_runs(tiny_onnx, tmp_path):
    with pytest.raises(UserError, match="no 'text_encoder_2' component"):
        quantize(tiny_onnx, tmp_path / "x", QuantizeConfig(recipe=_recipe(components="unet,text_encoder_2"), calibration=CAL))
    assert not (tmp_path / "x").exists()


def test_calibration_feeds_are_the_trajectories_final_latents(tiny_onnx):
    from onnxdiffusion.quantize.calibration import capture
    from onnxdiffusion.quantize.components import calibration_feeds

    pipe = Pipeline.from_folder(tiny_onnx)
    prompts = ["a red circle", "a blue star", "a ring", "a square"]
    calib = capture(pipe, prompts, CAL)
    feeds = calibration_feeds(pipe, "vae_decoder", calib, prompts)
    assert len(feeds) == 4
    scale = pipe.family.decode_scale_shift(pipe.info)[0]
    np.testing.assert_allclose(feeds[2]["latent_sample"][0], calib.latents[-1, 2] * scale, rtol=1e-6)
    te = calibration_feeds(pipe, "text_encoder", calib, prompts)
    assert len(te) == 5 and np.array_equal(te[-1]["input_ids"], pipe.tokenizer([""]))
