"""FLUX.2 [klein] and [dev]: `export` then `generate` reproduces diffusers' Flux2KleinPipeline / Flux2Pipeline
from the same initial latents (non-square, the folder's own scheduler with its empirical mu), text-to-image and
with reference pictures, in the host loop and the Loop graph (acceptance 1); the unrolled form, step caching,
run-time LoRA against diffusers' own loader, int8-static (its loop form too), and bad reference pictures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

H, W = 24, 40  # non-square: 6 x 10 patch tokens
STEPS = 4
PROMPT = "a small red circle on the left"
VARIANTS = {"klein": ("tiny_flux2_klein_diffusers", "tiny_flux2_klein_onnx", 4.0),
            "dev": ("tiny_flux2_dev_diffusers", "tiny_flux2_dev_onnx", 3.5)}


def _pictures() -> list:
    """Two reference pictures of sizes unlike the output's and each other's (multiples of 4, >= 64 a side)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((64, 96, 3), (72, 64, 3))]


def _latents(seed: int = 0) -> torch.Tensor:
    """diffusers' layout: patches (1, 4C, h/2, w/2)."""
    return torch.randn(1, 16, H // 4, W // 4, generator=torch.Generator().manual_seed(seed))


def _tokens(x: torch.Tensor) -> np.ndarray:
    return x.reshape(1, 16, -1).permute(0, 2, 1).numpy()  # Flux2 pipelines' _pack_latents


def _reference(src, guidance: float, latents: torch.Tensor, image=None, pipe=None) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe = pipe or DiffusionPipeline.from_pretrained(src, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    length = pipe.tokenizer.model_max_length if hasattr(pipe.tokenizer, "model_max_length") \
        else pipe.tokenizer.tokenizer.model_max_length
    kw = {} if image is None else {"image": image}
    out = pipe(prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance, latents=latents,
               max_sequence_length=length, output_type="np", **kw).images
    return (out * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def flux2_loops(request, tmp_path_factory) -> dict:
    """Each variant's folder with the Loop form compiled in."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    made = {}
    for name, (_, onnx_fixture, _) in VARIANTS.items():
        folder = tmp_path_factory.mktemp(f"flux2_{name}") / "model"
        shutil.copytree(request.getfixturevalue(onnx_fixture), folder)
        compile_loop(folder, folder, form="loop")
        made[name] = folder
    return made


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifest_records_family_template_and_batch_norm(variant, request):
    from diffusers import AutoencoderKLFlux2

    src_fixture, onnx_fixture, _ = VARIANTS[variant]
    src, folder = request.getfixturevalue(src_fixture), request.getfixturevalue(onnx_fixture)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["family"] == {"klein": "flux2_klein", "dev": "flux2"}[variant]
    for name, comp in manifest["components"].items():
        assert comp["validation"]["max_rel_error"] < 1e-4, name
    info = manifest["pipeline"]
    vae = AutoencoderKLFlux2.from_pretrained(src / "vae")
    assert info["vae_bn_mean"] == vae.bn.running_mean.tolist() and info["vae_bn_var"] == vae.bn.running_var.tolist()
    assert "{}" in info["prompt_template"] and info["text_layers"] == ([9, 18, 27] if variant == "klein" else [10, 20, 30])


@pytest.mark.parametrize("references", [0, 1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_matches_diffusers_host_and_loop(variant, references, flux2_loops, request):
    """Acceptance 1: >= 40 dB against diffusers (measured: identical uint8 images), text-to-image and editing."""
    src_fixture, _, guidance = VARIANTS[variant]
    image = _pictures()[:references] or None
    x = _latents()
    want = _reference(request.getfixturevalue(src_fixture), guidance, x, image)
    pipe = Pipeline.from_folder(flux2_loops[variant])
    for loop in ("host", "loop"):
        got = pipe(PROMPT, steps=STEPS, guidance=guidance, height=H, width=W, latents=_tokens(x), loop=loop,
                   **({} if image is None else {"image": image}))
        assert psnr(got.images, want) >= 40.0, loop


def test_unrolled_form_and_taylorseer_loop_match_the_host_loop(tiny_flux2_klein_onnx, tmp_path):
    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(tiny_flux2_klein_onnx, folder)
    compile_loop(folder, folder, form="unrolled", steps=3)
    compile_loop(folder, folder, form="loop", cache="taylorseer")
    pipe = Pipeline.from_folder(folder)
    kw = dict(steps=3, guidance=4.0, height=H, width=W, seed=3)
    host = pipe(PROMPT, **kw)
    assert psnr(pipe(PROMPT, loop="unrolled", **kw).images, host.images) >= 60
    kw["steps"] = 6
    cached = pipe(PROMPT, cache="taylorseer:2", **kw)
    assert psnr(cached.images, pipe(PROMPT, **kw).images) < 60  # the cache skipped something
    assert psnr(pipe(PROMPT, cache="taylorseer:2", loop="loop", **kw).images, cached.images) >= 60


def test_runtime_lora_matches_diffusers(tiny_flux2_klein_diffusers, tiny_flux2_klein_onnx, tmp_path):
    from diffusers import DiffusionPipeline
    from lora_helpers import make_lora

    from onnxdiffusion.adapters.folder import add_points

    lora = make_lora(tiny_flux2_klein_diffusers, tmp_path / "lora", seed=5)
    add_points(tiny_flux2_klein_onnx, tmp_path / "points")
    ref = DiffusionPipeline.from_pretrained(tiny_flux2_klein_diffusers, local_files_only=True)
    ref.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="a")
    ref.set_adapters(["a"], [0.8])
    x = _latents(1)
    want = _reference(None, 4.0, x, pipe=ref)
    pipe = Pipeline.from_folder(tmp_path / "points")
    got = pipe(PROMPT, steps=STEPS, guidance=4.0, height=H, width=W, latents=_tokens(x), loras=[(lora, 0.8)])
    plain = pipe(PROMPT, steps=STEPS, guidance=4.0, height=H, width=W, latents=_tokens(x))
    assert psnr(got.images, want) >= 40.0 and psnr(plain.images, want) < 40.0


@pytest.mark.filterwarnings("ignore:prompt truncated")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_int8_static_runs_and_its_loop_form_matches_the_host_loop(variant, request, tmp_path):
    """Acceptance 1's int8-static: calibrated over flow_euler trajectories of the family's own conditioning
    (empty reference inputs included); the probe PSNR against fp32 is the report's."""
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    _, onnx_fixture, guidance = VARIANTS[variant]
    out = tmp_path / "int8"
    report = quantize(request.getfixturevalue(onnx_fixture), out,
                      QuantizeConfig(recipe=recipe_class("int8-static").with_options({}),
                                     calibration=CalibrationConfig(count=4, steps=3, batch=4, sampler="flow_euler"),
                                     latency_runs=2, measure_memory=False))
    assert report["quality"]["probe_psnr_db"] > 20
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, guidance=guidance, seed=1, height=H, width=W)
    host = pipe(PROMPT, **kw)
    assert psnr(pipe(PROMPT, loop="loop", **kw).images, host.images) >= 60


def test_bad_reference_pictures_are_one_line_errors(tiny_flux2_klein_onnx, tmp_path):
    from PIL import Image

    pipe = Pipeline.from_folder(tiny_flux2_klein_onnx)
    small = Image.new("RGB", (40, 96))
    narrow = Image.new("RGB", (64, 600))
    for image, match in ((small, "at least 64"), (narrow, "aspect ratio"), ([_pictures()[0]] * 11, "at most 10"),
                         (Image.new("I;16", (64, 64)), "8-bit")):
        with pytest.raises(UserError, match=match) as info:
            pipe(PROMPT, steps=2, height=H, width=W, image=image)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="strength"):
        pipe(PROMPT, steps=2, height=H, width=W, image=_pictures()[0], strength=0.5)


def test_distilled_klein_ignores_guidance_like_diffusers(tiny_flux2_klein_diffusers, tiny_flux2_klein_onnx, tmp_path):
    """A step-distilled [klein] (model_index is_distilled) runs no CFG at any guidance, as Flux2KleinPipeline; the
    Loop graph then runs the cond batch alone."""
    from onnxdiffusion.folder.artifacts import hash_tree
    from onnxdiffusion.loopgraph.compile import compile_loop

    src = tmp_path / "src"
    shutil.copytree(tiny_flux2_klein_diffusers, src)
    index = json.loads((src / "model_index.json").read_text())
    (src / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    folder = tmp_path / "model"
    shutil.copytree(tiny_flux2_klein_onnx, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["pipeline"]["is_distilled"] = True  # what export records from that model_index
    manifest["files"] = hash_tree(folder)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    compile_loop(folder, folder, form="loop")
    x = _latents(2)
    want = _reference(src, 4.0, x)
    pipe = Pipeline.from_folder(folder)
    for loop in ("host", "loop"):
        got = pipe(PROMPT, steps=STEPS, guidance=4.0, height=H, width=W, latents=_tokens(x), loop=loop)
        assert psnr(got.images, want) >= 40.0, loop
