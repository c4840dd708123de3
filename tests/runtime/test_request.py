"""runtime/request.py: every check a generation needs before any model loads, in one library function that the
CLI's generate and the Python API share; the checks keep their order (cheap ones before the folder is read)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.runtime.options import GenerateOptions, GenerateRequest
from onnxdiffusion.runtime.request import generate, plan


@pytest.fixture
def no_loading(monkeypatch):
    """Any session made fails the test: plan() must refuse before a model loads."""
    from onnxdiffusion.runtime import pipeline

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(pipeline.Pipeline, "__init__", refuse)


@pytest.mark.parametrize("prompt, options, request_, message", [
    ("a\x00b", GenerateOptions(), GenerateRequest(), "NUL"),
    ("a", GenerateOptions(), GenerateRequest(negative_prompt="\x00"), "negative prompt"),
    ("a", GenerateOptions(), GenerateRequest(provider="nope"), "provider"),
    ("a", GenerateOptions(), GenerateRequest(memory="bogus=1"), "memory"),
    ("a", GenerateOptions(cache="warp:1"), GenerateRequest(), "cache"),
    ("a", GenerateOptions(strength=0.5), GenerateRequest(), "--mask and --strength need --image"),
    ("a", GenerateOptions(), GenerateRequest(control=("x.png",)), "one --control image per --controlnet"),
    ("a", GenerateOptions(steps=0), GenerateRequest(), "num_steps"),
    ("a", GenerateOptions(loop="unrolled"), GenerateRequest(), "compile-loop"),
    ("a", GenerateOptions(decoder="tiny"), GenerateRequest(), "tiny decoder"),
])
def test_bad_requests_are_refused_before_any_model_loads(tiny_onnx, no_loading, prompt, options, request_, message):
    with pytest.raises(UserError, match=message):
        plan(tiny_onnx, prompt, options, request_)


def test_cheap_checks_come_before_the_folder_is_read(tmp_path, no_loading):
    # a bad provider is named even though the folder does not exist
    with pytest.raises(UserError, match="provider"):
        plan(tmp_path / "missing", "a", GenerateOptions(), GenerateRequest(provider="nope"))
    seen = []
    with pytest.raises(UserError):
        plan(tmp_path / "missing", "a", GenerateOptions(batch=2), outputs=seen.append)
    assert seen == [2]  # the caller's output check ran, before the folder


def test_plan_resolves_the_options_as_generate_runs_them(tiny_onnx, no_loading):
    p = plan(tiny_onnx, "a red circle", GenerateOptions(steps=3), GenerateRequest())
    assert p.options.steps == 3 and p.options.loop == "host" and p.options.decoder == "full"
    assert p.options.guidance is not None and p.folder == tiny_onnx and p.prompt == "a red circle"
    assert p.loras == () and p.controls == () and p.picture is None


def test_the_python_twin_makes_the_pipelines_image(tiny_onnx):
    from onnxdiffusion.runtime import Pipeline

    got = generate(tiny_onnx, "a red circle", GenerateOptions(steps=2, seed=3))
    want = Pipeline.from_folder(tiny_onnx)("a red circle", steps=2, seed=3)
    np.testing.assert_array_equal(got.images, want.images)


def test_a_tagged_lora_that_does_not_combine_is_refused_before_it_loads(tiny_onnx, no_loading, monkeypatch, tmp_path):
    """`<lora:NAME:W>` in the prompt counts as a run-time LoRA in the table's check: with a ControlNet it is refused
    before the tag's file is looked up, a points copy made or the file read (each stubbed to fail)."""
    from PIL import Image

    from onnxdiffusion.adapters import feeds, folder, tags
    from onnxdiffusion.techniques import controlnet

    def loaded(*a, **k):
        raise AssertionError("the LoRA was loaded")
    for module, name in ((tags, "tagged_files"), (folder, "with_points"), (feeds, "build_feeds")):
        monkeypatch.setattr(module, name, loaded)
    monkeypatch.setattr(controlnet, "check_request", lambda *a, **k: None)  # as if the folder had the net
    Image.new("RGB", (32, 32)).save(tmp_path / "control.png")
    request = GenerateRequest(control=(tmp_path / "control.png",), controlnet=("edges",))
    with pytest.raises(UserError, match="run-time LoRAs with ControlNet") as info:
        plan(tiny_onnx, "a red circle <lora:style:0.5>", GenerateOptions(steps=2), request)
    assert "\n" not in str(info.value)


def test_control_inpaint_contexts_are_checked_before_any_model_loads(tiny_onnx, no_loading, tmp_path):
    """--control-inpaint PICTURE,MASK: one per --controlnet, refused as ControlNetSpec(inpaint=...) is, files read."""
    from PIL import Image

    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    png = tmp_path / "p.png"
    Image.new("RGB", (32, 32)).save(png)
    nets = dict(control=(png,), controlnet=("edges:0.5",))
    for contexts, message in [((f"{png},{png}", f"{png},{png}"), "one --control-inpaint PICTURE,MASK per --controlnet"),
                              ((str(png),), "ControlNet 'edges': inpaint must be (picture, mask)"),
                              ((f"{png},",), "inpaint must be (picture, mask)"),
                              ((f"{png},{tmp_path / 'missing.png'}",), "missing.png")]:
        with pytest.raises(UserError, match=re.escape(message)) as info:
            plan(tiny_onnx, "a", GenerateOptions(), GenerateRequest(**nets, control_inpaint=contexts))
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="has no ControlNet 'edges'"):  # a good context: on to the folder's checks
        plan(tiny_onnx, "a", GenerateOptions(), GenerateRequest(**nets, control_inpaint=(f"{png},{png}",)))
    from onnxdiffusion.runtime.request import _controls

    spec, = _controls(GenerateRequest(**nets, control_inpaint=(f"{png},{png}",)))
    assert isinstance(spec, ControlNetSpec) and (spec.name, spec.scale) == ("edges", 0.5) and len(spec.inpaint) == 2
    assert all(isinstance(p, Image.Image) for p in (spec.image, *spec.inpaint))  # read before any model loads
