"""The weights-only recipe (quantize/configs_float.py WeightsOnlyRecipe): an LLM text encoder alone to 8- or 4-bit
MatMulNBits weights, the backbone untouched, the image close to fp32's (issue 42, acceptance 3; the figures are
experiments/llm_text_encoders/te_weight_only.py's)."""

from __future__ import annotations

import functools

import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize import QuantizeConfig, quantize
from onnxdiffusion.quantize.configs import recipe_class
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

KW = dict(steps=3, guidance=3.0, seed=4, height=32, width=32)
EDIT_KW = dict(negative_prompt="blurry", steps=3, guidance=4.0, seed=4, height=64, width=96)


def _edit_picture():
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8))


@functools.cache
def _fp32_images(folder, edit: bool):
    """The fp32 folder's image of the cases' request, once per folder: every bits / gemms case made this same seeded
    call (only the quantized side differs between them)."""
    if edit:
        return Pipeline.from_folder(folder)("make the circle blue", image=_edit_picture(), **EDIT_KW).images
    return Pipeline.from_folder(folder)("a small red circle on the left", **KW).images


@pytest.mark.parametrize("fixture", ["tiny_zimage_onnx", "tiny_qwenimage_onnx"])
@pytest.mark.parametrize("bits,floor", [(8, 50.0), (4, 35.0)])
def test_text_encoder_alone_to_nbits(fixture, bits, floor, request, tmp_path):
    src = request.getfixturevalue(fixture)
    out = tmp_path / "q"
    recipe = recipe_class("weights-only").with_options({"bits": str(bits), "block_size": "16"})
    report = quantize(src, out, QuantizeConfig(recipe=recipe, latency_runs=1, measure_memory=False))
    assert report["sizes"]["text_encoder"]["ratio"] > 1.0
    ops = [n for n in onnx.load(str(out / "text_encoder" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert ops and all(next(a.i for a in n.attribute if a.name == "bits") == bits for n in ops)
    backbone = Pipeline.from_folder(src).family.backbone
    assert (out / backbone / "model.onnx").read_bytes() == (src / backbone / "model.onnx").read_bytes()
    ours = Pipeline.from_folder(out)("a small red circle on the left", **KW)
    assert psnr(ours.images, _fp32_images(src, False)) >= floor


@pytest.mark.parametrize("bits,gemms,floor", [(8, "keep", 50.0), (4, "keep", 35.0), (8, "quantize", 50.0)])
def test_vl_text_encoder_of_an_edit_model(tiny_qwenedit_onnx, bits, gemms, floor, tmp_path):
    """Qwen-Image-Edit's text encoder holds the vision tower: quantize's latency run needs a feed whose picture
    patches and picture tokens agree (Family.timing_feed); the edit stays close to fp32's. The tower's linears
    are Gemms: float unless gemms=quantize."""
    out = tmp_path / "q"
    recipe = recipe_class("weights-only").with_options({"bits": str(bits), "block_size": "16", "gemms": gemms})
    report = quantize(tiny_qwenedit_onnx, out, QuantizeConfig(recipe=recipe, latency_runs=1, measure_memory=False))
    assert report["sizes"]["text_encoder"]["ratio"] > 1.0 and report["latency"]["text_encoder"]["median_ms"] > 0
    ops = [n.op_type for n in onnx.load(str(out / "text_encoder" / "model.onnx")).graph.node]
    assert "MatMulNBits" in ops and ("Gemm" in ops) == (gemms == "keep")
    ours = Pipeline.from_folder(out)("make the circle blue", image=_edit_picture(), **EDIT_KW)
    assert psnr(ours.images, _fp32_images(tiny_qwenedit_onnx, True)) >= floor


@pytest.mark.parametrize("options, fragment", [({"bits": "3"}, "bits must be 4 or 8"),
                                               ({"components": "vae_decoder"}, "weights-only component"),
                                               ({"block_size": "24"}, "block_size"),
                                               ({"gemms": "int4"}, "gemms")])
def test_bad_options_are_one_line_errors(options, fragment):
    with pytest.raises(UserError, match=fragment):
        recipe_class("weights-only").with_options(options)


def test_gemms_keep_is_left_out_of_the_recipe_dict():
    """gemms came without a version bump: folders made before it keep their manifest's bytes."""
    assert "gemms" not in recipe_class("weights-only")().to_dict()
    assert recipe_class("weights-only").with_options({"gemms": "quantize"}).to_dict()["gemms"] == "quantize"
