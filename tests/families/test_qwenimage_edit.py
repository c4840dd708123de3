"""Qwen-Image-Edit and -Edit-Plus (issue 42, editing by instruction): `export` then `pipe(prompt, image=...)`
reproduces QwenImageEditPipeline / QwenImageEditPlusPipeline given the same initial latents, prompt, negative
prompt, steps and true-CFG scale, host loop and Loop graph, on a non-square output from non-square pictures (the
picture through the VL text encoder's vision tower and as reference latents; Edit-Plus with two pictures of
different shapes); int8-static runs and its PSNR is printed. Sizes the pipelines choose, and bad requests (one
line, nothing written)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.families.qwenimage_edit import QwenImageEdit, calculate_dimensions
from onnxdiffusion.folder.manifest import PipelineInfo

H, W = 96, 160  # the output (non-square): 3 x 5 tokens beside the 1 MP reference's ~1000
STEPS, GUIDANCE = 4, 4.0
PROMPT, NEGATIVE = "make the circle blue", "blurry"


def _picture(height: int, width: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _info(plus: bool, default: int = 1024) -> PipelineInfo:
    return PipelineInfo.from_dict({"vae_scaling_factor": 1.0, "vae_scale_factor": 8, "size_multiple": 16,
                                   "latent_channels": 16, "default_height": default, "default_width": default,
                                   "model_max_length": 1088, "num_train_timesteps": 1000, "edit_plus": plus})


@pytest.mark.parametrize("size", [(480, 640), (1000, 333), (512, 512), (1080, 1920), (50, 2000)])
def test_sizes_are_the_pipelines(size):
    """A released folder (1024 x 1024 default): the reference is encoded at, and the output defaults to, the
    size diffusers' calculate_dimensions picks (Edit: the first picture's, Edit-Plus: the last's)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    family, h, w = QwenImageEdit(), *size
    want_w, want_h, _ = edit.calculate_dimensions(1024 * 1024, w / h)
    assert calculate_dimensions(1024 * 1024, w / h) == plus.calculate_dimensions(1024 * 1024, w / h)
    assert family.reference_size(_info(False), h, w) == (want_h, want_w)
    assert family.default_size(_info(False), [_picture(h, w), _picture(30, 20)]) == (want_h // 16 * 16, want_w // 16 * 16)
    assert family.default_size(_info(True), [_picture(30, 20), _picture(h, w)]) == (want_h // 16 * 16, want_w // 16 * 16)


def _uint8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def _latents(ref_pipe, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    f = 2 * ref_pipe.vae_scale_factor
    return ref_pipe._pack_latents(torch.randn(1, 4, 2 * H // f, 2 * W // f, generator=g), 1, 4, 2 * H // f, 2 * W // f)


def _every_form(folder, tmp_path, **kwargs):
    """(host loop, Loop graph, unrolled graph) results of the same request."""
    import shutil

    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.runtime import Pipeline

    host = Pipeline.from_folder(folder)(PROMPT, **kwargs)
    compiled = tmp_path / "model"
    shutil.copytree(folder, compiled)
    compile_loop(compiled, compiled, form="loop")
    compile_loop(compiled, compiled, form="unrolled", steps=kwargs["steps"])
    pipe = Pipeline.from_folder(compiled)
    return (host, *(pipe(PROMPT, loop=form, **kwargs) for form in ("loop", "unrolled")))


@pytest.mark.slow
@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit_plus"])
def test_edit_matches_diffusers_in_every_loop_form(tiny_qwenedit_diffusers, tiny_qwenedit_onnx, tiny_qwenedit_plus_diffusers,
                                              tiny_qwenedit_plus_onnx, plus, tmp_path):
    """The picture(s) reach the vision tower and the backbone as reference latents; Edit-Plus with two pictures
    of different aspect ratios (each its own grid and frame, its own "Picture i:" vision tokens)."""
    from tiny_qwenedit import load_pipeline

    src, folder = (tiny_qwenedit_plus_diffusers, tiny_qwenedit_plus_onnx) if plus else (tiny_qwenedit_diffusers,
                                                                                         tiny_qwenedit_onnx)
    ref_pipe = load_pipeline(src)
    image = [_picture(48, 80), _picture(90, 60, seed=1)] if plus else _picture(48, 80)
    latents = _latents(ref_pipe)
    want = _uint8(ref_pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE, height=H,
                           width=W, num_inference_steps=STEPS, latents=latents, output_type="np").images)
    results = _every_form(folder, tmp_path, image=image, negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE,
                          height=H, width=W, latents=latents.numpy())
    db_host, db_loop, db_unrolled = (psnr(r.images, want) for r in results)
    print(f"qwen-image-edit{'-plus' if plus else ''}: host {db_host:.1f} dB, Loop graph {db_loop:.1f} dB, unrolled "
          f"{db_unrolled:.1f} dB vs diffusers")
    assert db_host >= 40.0 and db_loop >= 40.0 and db_unrolled >= 40.0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["flow_heun", "dpmpp_2m"])
def test_edit_other_flow_samplers_match_diffusers(tiny_qwenedit_diffusers, tiny_qwenedit_onnx, sampler):
    """The folder's other flow samplers against diffusers' schedulers driven on the pipeline's sigmas and mu
    (tests/helpers/flow_twins.py, as for Qwen-Image)."""
    from flow_twins import driven
    from tiny_qwenedit import load_pipeline

    from onnxdiffusion.runtime import Pipeline

    ref_pipe = load_pipeline(tiny_qwenedit_diffusers)
    ref_pipe.scheduler = driven(sampler, ref_pipe.scheduler.config)
    latents = _latents(ref_pipe, seed=2)
    want = _uint8(ref_pipe(image=_picture(48, 80), prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE,
                           height=H, width=W, num_inference_steps=STEPS, latents=latents, output_type="np").images)
    got = Pipeline.from_folder(tiny_qwenedit_onnx)(PROMPT, image=_picture(48, 80), negative_prompt=NEGATIVE,
                                                   steps=STEPS, guidance=GUIDANCE, sampler=sampler, height=H, width=W,
                                                   latents=latents.numpy())
    db = psnr(got.images, want)
    print(f"qwen-image-edit {sampler}: host {db:.1f} dB vs diffusers")
    assert db >= 40.0


@pytest.mark.slow
def test_default_output_size_follows_the_picture(tiny_qwenedit_onnx):
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(tiny_qwenedit_onnx)  # default 64 x 64: a 4096-pixel area at the picture's aspect
    assert pipe(PROMPT, image=_picture(48, 80), steps=2).images.shape == (1, 64, 96, 3)
    assert pipe(PROMPT, image=_picture(80, 48), steps=2, height=32).images.shape == (1, 32, 64, 3)


@pytest.mark.slow
def test_int8_static_edits(tiny_qwenedit_onnx, tmp_path):
    """int8-static calibrates on the probe picture (no picture is given to quantize) and the quantized model
    edits; its PSNR against fp32 is printed (random weights: reported, not judged).

    The op groups are named as `auto` picks them here (modulation int8; norms and softmax over the error budget,
    attention float as not faster): auto's error probes and timings on this 1,024-token sequence were ~12 of
    the quantization's ~21 CPU s, and the folder is the same (the same SQNR 40.68 dB and probe 59.09 dB both ways).
    auto's choosing on this backbone class is test_flow_families' int8-static case on Qwen-Image."""
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class
    from onnxdiffusion.runtime import Pipeline

    out = tmp_path / "int8"
    cal = CalibrationConfig(count=4, steps=3, batch=2, sampler="flow_euler")
    recipe = recipe_class("int8-static").with_options({"modulation": "int8", "attention": "float", "softmax": "float",
                                                       "norms": "float"})
    report = quantize(tiny_qwenedit_onnx, out, QuantizeConfig(recipe=recipe, calibration=cal, latency_runs=1,
                                                              measure_memory=False))
    print(f"qwen-image-edit int8-static probe PSNR (the quantize report's): {report['quality']['probe_psnr_db']:.1f} dB")
    kw = dict(image=_picture(48, 80), negative_prompt=NEGATIVE, steps=STEPS, guidance=GUIDANCE, height=H, width=W, seed=4)
    fp32 = Pipeline.from_folder(tiny_qwenedit_onnx)(PROMPT, **kw)
    int8 = Pipeline.from_folder(out)(PROMPT, **kw)
    db = psnr(int8.images, fp32.images)
    print(f"qwen-image-edit int8-static vs fp32: {db:.1f} dB")
    assert np.isfinite(int8.latents).all() and db > 10.0


@pytest.mark.slow
@pytest.mark.parametrize("kwargs,match", [
    ({}, "edits a picture: give the picture to edit"),
    ({"image": "rgb", "strength": 0.5}, "takes no mask or strength"),
    ({"image": ["rgb", "rgb"]}, "Qwen-Image-Edit \\(not Plus\\) model takes 1 to 1 reference"),
    ({"image": np.zeros((1, 4, 4, 4), np.float32)}, "reads the picture itself"),
])
def test_bad_edit_requests_are_one_line(tiny_qwenedit_onnx, kwargs, match):
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(tiny_qwenedit_onnx)
    rgb = np.asarray(_picture(40, 60))
    fix = {k: ([rgb] * len(v) if isinstance(v, list) else rgb if isinstance(v, str) else v) for k, v in kwargs.items()}
    with pytest.raises(UserError, match=match) as e:
        pipe(PROMPT, steps=2, height=H, width=W, **fix)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_export_needs_the_processor_folder(tiny_qwenedit_diffusers, tmp_path):
    import shutil

    from onnxdiffusion.export import export_pipeline

    src = tmp_path / "src"
    shutil.copytree(tiny_qwenedit_diffusers, src)
    shutil.rmtree(src / "processor")
    with pytest.raises(UserError, match="'processor' folder") as e:
        export_pipeline(src, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_edit_plus_two_pictures_is_the_python_api(tiny_qwenedit_plus_onnx, tmp_path):
    """`generate MODEL PROMPT --image a.png --image b.png` (no size: the last picture's aspect) draws what
    `pipe(prompt, image=[a, b])` draws."""
    from PIL import Image

    from cli_helpers import run_cli_here
    from onnxdiffusion.runtime import Pipeline

    a, b = _picture(48, 80), _picture(100, 50, seed=1)
    a.save(tmp_path / "a.png")
    b.save(tmp_path / "b.png")
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_qwenedit_plus_onnx, PROMPT, "--image", tmp_path / "a.png", "--image",
                        tmp_path / "b.png", "--steps", 2, "--guidance", GUIDANCE, "--seed", 5, "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = Pipeline.from_folder(tiny_qwenedit_plus_onnx)(PROMPT, image=[a, b], steps=2, guidance=GUIDANCE, seed=5)
    got = np.asarray(Image.open(out))[None]
    assert got.shape == want.images.shape == (1, 96, 32, 3)  # a 4096-pixel area at b's 1:2
    assert psnr(got, want.images) == float("inf")
