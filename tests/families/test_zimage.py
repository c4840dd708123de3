"""Z-Image (families/zimage.py): `export` then `generate` reproduces ZImagePipeline given the same initial latents
(issue 42, acceptance 1), at a non-square size, with and without guidance, a negative prompt longer than the
prompt (captions of different lengths in one CFG batch), every flow sampler, the folder's own scheduler and a
dynamic-shift one; the Loop and unrolled graphs agree with the host loop; int8-static runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.samplers import FLOW_SAMPLERS

pytestmark = pytest.mark.slow

H, W = 48, 32  # 12 x 8 latents: 24 patch tokens, padded to 32 by the transformer's own pad token
STEPS = 4
PROMPT = "a small red circle on the left"
LONG_NEGATIVE = ("blurry, low quality, a photo of a cat, a big blue square above a yellow triangle on the right, "
                 "a green ring below a violet star")


@pytest.fixture(scope="module")
def zimage_pair(tiny_zimage_diffusers, tiny_zimage_onnx):
    from diffusers import ZImagePipeline

    ref = ZImagePipeline.from_pretrained(tiny_zimage_diffusers)
    ref.set_progress_bar_config(disable=True)
    return ref, Pipeline.from_folder(tiny_zimage_onnx)


def _latents(seed: int) -> torch.Tensor:
    return torch.randn(1, 4, H // 4, W // 4, generator=torch.Generator().manual_seed(seed))


def _uint8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def _diffusers(ref, guidance: float, negative: str | None, latents, steps: int = STEPS) -> np.ndarray:
    kw = {} if negative is None else {"negative_prompt": negative}
    return _uint8(ref(PROMPT, height=H, width=W, num_inference_steps=steps, guidance_scale=guidance, latents=latents,
                      output_type="np", **kw).images)


def test_manifest_records_validation_and_the_rendered_chat_template(tiny_zimage_onnx, zimage_pair):
    ref, pipe = zimage_pair
    manifest = json.loads((tiny_zimage_onnx / "manifest.json").read_text())
    assert manifest["family"] == "zimage"
    for name, comp in manifest["components"].items():
        assert comp["validation"]["max_rel_error"] < 1e-4, name
        first, second = comp["shapes_validated"]
        assert first != second and first["batch_size"] != second["batch_size"], name
    template = manifest["pipeline"]["chat_templates"]["text_encoder"]
    rendered = ref.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True)
    assert template.format(PROMPT) == rendered


@pytest.mark.parametrize("guidance,negative", [(3.0, None), (0.0, None), (4.0, LONG_NEGATIVE)])
def test_generate_matches_diffusers(zimage_pair, guidance, negative):
    """guidance is diffusers' guidance_scale (pos + g (pos - neg)); 0 runs the prompt alone."""
    ref, pipe = zimage_pair
    latents = _latents(0)
    want = _diffusers(ref, guidance, negative, latents)
    got = pipe(PROMPT, negative_prompt=negative, steps=STEPS, guidance=guidance, height=H, width=W,
               latents=latents.numpy())
    assert psnr(got.images, want) >= 40.0


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_every_flow_sampler_matches_its_diffusers_twin(zimage_pair, sampler):
    from test_flow_families import _scheduler

    ref, pipe = zimage_pair
    own = ref.scheduler
    ref.scheduler = _scheduler(ref, sampler)
    try:
        latents = _latents(1)
        want = _diffusers(ref, 2.0, None, latents)
    finally:
        ref.scheduler = own
    got = pipe(PROMPT, steps=STEPS, sampler=sampler, guidance=2.0, height=H, width=W, latents=latents.numpy())
    assert psnr(got.images, want) >= 40.0


def test_dynamic_shift_scheduler_matches_diffusers(zimage_pair, tiny_zimage_onnx, tmp_path):
    """A folder whose scheduler shifts by the image's token count (mu from (h/2)(w/2), as ZImagePipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref, _ = zimage_pair
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
              "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 16,
              "max_image_seq_len": 256}
    folder = tmp_path / "model"
    shutil.copytree(tiny_zimage_onnx, folder)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    pipe = Pipeline.from_folder(folder, verify=False)
    own = ref.scheduler
    ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    try:
        latents = _latents(2)
        want = _diffusers(ref, 3.0, None, latents)
    finally:
        ref.scheduler = own
    got = pipe(PROMPT, steps=STEPS, guidance=3.0, height=H, width=W, latents=latents.numpy())
    assert psnr(got.images, want) >= 40.0


@pytest.fixture(scope="module")
def zimage_loops(tiny_zimage_onnx, tmp_path_factory):
    """The folder with its Loop graph and a STEPS-step unrolled graph: both negative-prompt cases read it."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path_factory.mktemp("zimage_loops") / "model"
    shutil.copytree(tiny_zimage_onnx, folder)
    compile_loop(folder, folder, form="loop")
    compile_loop(folder, folder, form="unrolled", steps=STEPS)
    return Pipeline.from_folder(folder)


@pytest.mark.parametrize("negative", [None, LONG_NEGATIVE])
def test_loop_and_unrolled_forms_match_the_host_loop_and_diffusers(zimage_pair, zimage_loops, negative):
    ref, _ = zimage_pair
    pipe = zimage_loops
    latents = _latents(3)
    want = _diffusers(ref, 3.0, negative, latents)
    kw = dict(steps=STEPS, guidance=3.0, height=H, width=W, latents=latents.numpy(), negative_prompt=negative)
    host = pipe(PROMPT, **kw)
    for form in ("loop", "unrolled"):
        got = pipe(PROMPT, loop=form, **kw)
        assert psnr(got.images, host.images) >= 60.0, form
        assert psnr(got.images, want) >= 40.0, form


@pytest.mark.parametrize("name,options", [("int8-static", {}), ("int4-weights", {"block_size": "16"})])
def test_quantized_backbone_runs_and_its_loop_form_matches_the_host_loop(tiny_zimage_onnx, tmp_path, name, options):
    """int8-static calibrates on the family's own conditioning (caption rows and their mask) over flow_euler
    trajectories; int4-weights is the low-bit recipe (MatMulNBits) on the transformer."""
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    cal = CalibrationConfig(count=4, steps=3, batch=4, sampler="flow_euler", guidance=3.0)
    out = tmp_path / name
    report = quantize(tiny_zimage_onnx, out, QuantizeConfig(recipe=recipe_class(name).with_options(options),
                                                            calibration=cal, latency_runs=2, measure_memory=False))
    assert report["quality"]["probe_psnr_db"] > 20
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, guidance=3.0, seed=1, height=H, width=W)
    host = pipe(PROMPT, **kw)
    assert psnr(pipe(PROMPT, loop="loop", **kw).images, host.images) >= 60


@pytest.mark.parametrize("method", ["first_block:0.2", "taylorseer:2", "residual:2"])
def test_step_caching_host_and_loop_agree(tiny_zimage_onnx, tmp_path, method):
    """cache_block_pattern names the main layers: the refiners run every step, the cached span is layers 1.."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(tiny_zimage_onnx, folder)
    compile_loop(folder, folder, form="loop", cache=method.split(":")[0])
    pipe = Pipeline.from_folder(folder)
    kw = dict(steps=6, guidance=3.0, seed=2, height=H, width=W, cache=method)
    host = pipe(PROMPT, **kw)
    loop = pipe(PROMPT, loop="loop", **kw)
    plain = pipe(PROMPT, steps=6, guidance=3.0, seed=2, height=H, width=W)
    assert psnr(loop.images, host.images) >= 50
    assert psnr(host.images, plain.images) >= 20  # cached, still the same picture


def test_mixed_components_are_refused(tiny_zimage_diffusers, tmp_path):
    from onnxdiffusion.export import export_pipeline

    src = tmp_path / "zimage"
    shutil.copytree(tiny_zimage_diffusers, src)
    cfg = json.loads((src / "transformer" / "config.json").read_text())
    cfg["cap_feat_dim"] = 32
    (src / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="cap_feat_dim"):
        export_pipeline(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def zimage_lora(tiny_zimage_diffusers, tiny_zimage_onnx, tmp_path_factory):
    from lora_helpers import make_lora

    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.loopgraph.compile import compile_loop

    root = tmp_path_factory.mktemp("zimage_lora")
    points = root / "points"
    add_points(tiny_zimage_onnx, points)
    compile_loop(points, points, form="loop")
    return points, make_lora(tiny_zimage_diffusers, root / "lora", seed=11, std=0.2)


def test_runtime_lora_matches_diffusers_host_and_loop(zimage_lora, tiny_zimage_diffusers, tiny_zimage_onnx):
    """The transformer's nodes carry diffusers' module paths: a peft LoRA over its attention projections runs
    through the insertion points, in the host loop and the Loop graph, as diffusers' load_lora_weights does."""
    from lora_helpers import diffusers_lora_images

    points, lora = zimage_lora
    pipe = Pipeline.from_folder(points)
    kw = dict(steps=STEPS, guidance=3.0, seed=5, height=H, width=W)
    plain = pipe(PROMPT, **kw)
    np.testing.assert_array_equal(plain.images, Pipeline.from_folder(tiny_zimage_onnx)(PROMPT, **kw).images)
    ours = pipe(PROMPT, loras=[(lora, 0.7)], **kw)
    ref = diffusers_lora_images(tiny_zimage_diffusers, [(lora, 0.7)], PROMPT, ours.init_latents, STEPS, 3.0, (H, W))
    assert psnr(ours.images, ref) >= 40.0
    assert psnr(ours.images, plain.images) < 37.0  # the LoRA visibly changes the image
    assert psnr(pipe(PROMPT, loras=[(lora, 0.7)], loop="loop", **kw).images, ours.images) >= 60.0


def test_fused_lora_matches_diffusers(zimage_lora, tiny_zimage_diffusers, tmp_path):
    from lora_helpers import diffusers_lora_images

    from onnxdiffusion.export import ExportOptions, export_pipeline

    _, lora = zimage_lora
    out = tmp_path / "fused"
    export_pipeline(tiny_zimage_diffusers, out, ExportOptions(components=("text_encoder", "transformer", "vae_decoder"),
                                                              default_size=32, loras=((lora, 0.7),)), progress=False)
    ours = Pipeline.from_folder(out)(PROMPT, steps=STEPS, guidance=3.0, seed=5, height=H, width=W)
    ref = diffusers_lora_images(tiny_zimage_diffusers, [(lora, 0.7)], PROMPT, ours.init_latents, STEPS, 3.0, (H, W))
    assert psnr(ours.images, ref) >= 40.0


def test_tokenizer_without_a_chat_template_is_refused(tiny_zimage_diffusers, tmp_path):
    from onnxdiffusion.export import export_pipeline

    src = tmp_path / "zimage"
    shutil.copytree(tiny_zimage_diffusers, src)
    (src / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = src / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="no usable chat template"):
        export_pipeline(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_manifest_template_without_its_placeholder_is_refused(tiny_zimage_onnx, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_zimage_onnx, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["pipeline"]["chat_templates"]["text_encoder"] = "<|im_start|>user\n"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="chat_templates"):
        Pipeline.from_folder(folder, verify=False)


def test_magcache_calibrates_and_runs(tiny_zimage_onnx, tmp_path):
    """MagCache's ratios are calibrated into the folder (cache calibrate) over the main layers, then skip steps."""
    from onnxdiffusion.techniques.cache_magcache import calibrate

    folder = tmp_path / "model"
    shutil.copytree(tiny_zimage_onnx, folder)
    calibrate(Pipeline.from_folder(folder), [PROMPT, "a blue square"], steps=6, guidance=3.0)
    pipe = Pipeline.from_folder(folder, verify=False)
    kw = dict(steps=6, guidance=3.0, seed=2, height=H, width=W)
    cached = pipe(PROMPT, cache="magcache:0.5", **kw)
    assert psnr(cached.images, pipe(PROMPT, **kw).images) >= 20


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_img2img_matches_diffusers_img2img_pipeline(zimage_pair, tiny_zimage_diffusers, strength):
    """`image=` scaled latents and `strength`: ZImageImg2ImgPipeline's start step and scale_noise, from our noise."""
    from diffusers import ZImageImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    _, pipe = zimage_pair
    rng = np.random.default_rng(7)
    image = rng.standard_normal((1, 4, H // 4, W // 4)).astype(np.float32)
    noise = rng.standard_normal((1, 4, H // 4, W // 4)).astype(np.float32)
    want = image_pipeline_images(ZImageImg2ImgPipeline, tiny_zimage_diffusers, PROMPT, image, noise, 6, 3.0, strength,
                                 height=H, width=W)
    got = pipe(PROMPT, image=image, strength=strength, latents=noise, steps=6, guidance=3.0, height=H, width=W)
    assert psnr(got.images, want) >= 40.0


def test_a_batch_of_captions_of_different_lengths_matches_diffusers(zimage_pair):
    """Two prompts in one batch whose captions pad to 32 and 64 tokens: the shorter row's raggedness is masked."""
    ref, pipe = zimage_pair
    prompts = [PROMPT, LONG_NEGATIVE]
    latents = torch.randn(2, 4, H // 4, W // 4, generator=torch.Generator().manual_seed(9))
    # (a copy: ZImagePipeline writes the templated prompts back into the list it is given)
    want = _uint8(ref(list(prompts), height=H, width=W, num_inference_steps=STEPS, guidance_scale=3.0, latents=latents,
                      output_type="np").images)
    got = pipe(prompts, batch=2, steps=STEPS, guidance=3.0, height=H, width=W, latents=latents.numpy())
    assert psnr(got.images, want) >= 40.0
