"""img2img: `pipe(prompt, image=..., strength=...)` reproduces diffusers' Img2Img pipelines from the same
image latents and noise (issue 24, acceptance 1): every sampler on SD and SDXL, the flow samplers on SD3,
Flux and Qwen-Image; the Loop and unrolled forms match the host loop; the VAE encoder gives diffusers'
posterior mean."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

PROMPT = "a small red circle on the left"
DISCRETE = ("ddim", "euler", "euler_a", "dpmpp_2m")


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.8, rng.standard_normal(shape, dtype=np.float32))


@pytest.fixture(scope="module")
def sd_pipe(tiny_onnx):
    return Pipeline.from_folder(tiny_onnx)


@pytest.mark.parametrize("sampler", DISCRETE)
@pytest.mark.parametrize("strength", [0.55, 1.0])
def test_sd_img2img_matches_diffusers(tiny_diffusers, sd_pipe, sampler, strength):
    from diffusers import StableDiffusionImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    image, noise = _inputs((1, 4, 8, 8))
    ours = sd_pipe(PROMPT, image=image, latents=noise, strength=strength, steps=10, sampler=sampler, guidance=4.0,
                   seed=1)
    ref = image_pipeline_images(StableDiffusionImg2ImgPipeline, tiny_diffusers, PROMPT, image, noise, 10, 4.0, strength,
                                sampler=sampler, step_noise=ours.noise)
    got = psnr(ours.images, ref)
    print(f"sd {sampler} strength {strength}: {got:.1f} dB")
    assert got >= 40.0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", DISCRETE)
def test_sdxl_img2img_matches_diffusers(tiny_sdxl_diffusers, tiny_sdxl_onnx, sampler):
    from diffusers import StableDiffusionXLImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    pipe = Pipeline.from_folder(tiny_sdxl_onnx)
    image, noise = _inputs((1, 4, 8, 8), seed=2)
    ours = pipe(PROMPT, image=image, latents=noise, strength=0.7, steps=8, sampler=sampler, guidance=5.0, seed=2)
    ref = image_pipeline_images(StableDiffusionXLImg2ImgPipeline, tiny_sdxl_diffusers, PROMPT, image, noise, 8, 5.0,
                                0.7, sampler=sampler, step_noise=ours.noise)
    got = psnr(ours.images, ref)
    print(f"sdxl {sampler}: {got:.1f} dB")
    assert got >= 40.0


def _flow_scheduler(sampler):
    """The diffusers scheduler a flow sampler reproduces, on the pipeline's own sigmas (test_flow_families)."""
    def make(pipe):
        from test_flow_families import _scheduler

        return _scheduler(pipe, sampler)
    return make


FLOW = ("flow_euler", "flow_heun", "dpmpp_2m")
# Flux and Qwen-Image hand their scheduler sigmas; retrieve_timesteps then counts a Heun schedule's 2N - 1
# timesteps as N steps, so their img2img pipelines cut a Heun schedule at the wrong row (and diffusers' Heun
# takes no sigmas: it never runs there as shipped). The Heun cut (two rows per step) is checked on SD3.
PACKED_FLOW = ("flow_euler", "dpmpp_2m")


@pytest.mark.slow
@pytest.mark.parametrize("sampler", FLOW)
def test_sd3_img2img_matches_diffusers(tiny_sd3_diffusers, tiny_sd3_onnx, sampler):
    from diffusers import StableDiffusion3Img2ImgPipeline
    from img2img_oracle import image_pipeline_images

    pipe = Pipeline.from_folder(tiny_sd3_onnx)
    image, noise = _inputs((1, 16, 8, 8), seed=3)
    ours = pipe(PROMPT, image=image, latents=noise, strength=0.75, steps=6, sampler=sampler, guidance=4.0,
                height=32, width=32)
    ref = image_pipeline_images(StableDiffusion3Img2ImgPipeline, tiny_sd3_diffusers, PROMPT, image, noise, 6, 4.0,
                                0.75, scheduler=_flow_scheduler(sampler), height=32, width=32,
                                max_sequence_length=pipe.info["max_lengths"]["text_encoder_3"])
    got = psnr(ours.images, ref)
    print(f"sd3 {sampler}: {got:.1f} dB")
    assert got >= 40.0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", PACKED_FLOW)
def test_flux_img2img_matches_diffusers(tiny_flux_diffusers, tiny_flux_onnx, sampler):
    from diffusers import FluxImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    from onnxdiffusion.families.latents import pack_patches

    pipe = Pipeline.from_folder(tiny_flux_onnx)
    image, noise = _inputs((1, 4, 16, 16), seed=4)
    ours = pipe(PROMPT, image=image, latents=pack_patches(noise), strength=0.6, steps=6, sampler=sampler,
                guidance=3.5, height=32, width=32)
    ref = image_pipeline_images(FluxImg2ImgPipeline, tiny_flux_diffusers, PROMPT, image, noise, 6, 3.5, 0.6,
                                scheduler=_flow_scheduler(sampler), height=32, width=32,
                                max_sequence_length=pipe.info["max_lengths"]["text_encoder_2"])
    got = psnr(ours.images, ref)
    print(f"flux {sampler}: {got:.1f} dB")
    assert got >= 40.0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", PACKED_FLOW)
def test_qwenimage_img2img_matches_diffusers(tiny_qwenimage_diffusers, tiny_qwenimage_onnx, sampler):
    from diffusers import QwenImageImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    from onnxdiffusion.families.latents import pack_patches

    pipe = Pipeline.from_folder(tiny_qwenimage_onnx)
    image, noise = _inputs((1, 4, 8, 8), seed=5)
    ours = pipe(PROMPT, negative_prompt="blurry", image=image, latents=pack_patches(noise), strength=0.8, steps=6,
                sampler=sampler, guidance=4.0, height=32, width=32)
    ref = image_pipeline_images(QwenImageImg2ImgPipeline, tiny_qwenimage_diffusers, PROMPT, image, noise, 6, 1.0, 0.8,
                                scheduler=_flow_scheduler(sampler), height=32, width=32, negative_prompt="blurry",
                                true_cfg_scale=4.0)
    got = psnr(ours.images, ref)
    print(f"qwenimage {sampler}: {got:.1f} dB")
    assert got >= 40.0


@pytest.fixture(scope="module")
def qwen_with_encoder(tiny_qwenimage_enc_onnx):
    """The tiny Qwen-Image folder as export_family makes it, plus its VAE encoder (conftest: once per run)."""
    return tiny_qwenimage_enc_onnx


@pytest.mark.slow
def test_qwenimage_vae_encoder_gives_diffusers_normalized_mean(tiny_qwenimage_diffusers, qwen_with_encoder):
    """The video VAE's encoder takes the picture as one frame: its posterior mean, normalized with the VAE's
    per-channel latents_mean / latents_std as QwenImageImg2ImgPipeline does."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    pipe = Pipeline.from_folder(qwen_with_encoder)
    rgb = np.random.default_rng(11).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    ours = pipe.encode_image(rgb)
    vae = AutoencoderKLQwenImage.from_pretrained(tiny_qwenimage_diffusers / "vae")
    pixels = torch.from_numpy(rgb.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)[None, :, None]
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean[:, :, 0].numpy()
    shape = (1, -1, 1, 1)
    want = (mean - np.asarray(vae.config.latents_mean).reshape(shape)) / np.asarray(vae.config.latents_std).reshape(shape)
    assert ours.shape == want.shape == (1, 4, 8, 8)
    assert np.abs(ours - want).max() <= 2e-3 * max(1.0, float(np.abs(want).max()))


@pytest.mark.slow
def test_qwenimage_picture_in_matches_diffusers_encoding_it(tiny_qwenimage_diffusers, qwen_with_encoder):
    """An RGB picture into Qwen-Image img2img: diffusers encodes the same picture with its own VAE."""
    from PIL import Image
    from diffusers import QwenImageImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    from onnxdiffusion.families.latents import pack_patches

    pipe = Pipeline.from_folder(qwen_with_encoder)
    rgb = np.random.default_rng(12).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    _, noise = _inputs((1, 4, 8, 8), seed=12)
    ours = pipe(PROMPT, image=rgb, latents=pack_patches(noise), strength=0.7, steps=6, sampler="flow_euler",
                guidance=1.0, height=32, width=32)
    ref = image_pipeline_images(QwenImageImg2ImgPipeline, tiny_qwenimage_diffusers, PROMPT, Image.fromarray(rgb),
                                noise, 6, 1.0, 0.7, scheduler=_flow_scheduler("flow_euler"), height=32, width=32)
    got = psnr(ours.images, ref)
    print(f"qwenimage picture in: {got:.1f} dB")
    assert got >= 40.0


@pytest.fixture(scope="module")
def sd_loops(tiny_onnx, tmp_path_factory):
    """The tiny SD folder with a Loop graph and a 6-evaluation unrolled graph."""
    import shutil

    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path_factory.mktemp("img2img_loops") / "model"
    shutil.copytree(tiny_onnx, folder)
    compile_loop(folder, folder, form="loop")
    compile_loop(folder, folder, form="unrolled", steps=6)
    return Pipeline.from_folder(folder)


@pytest.mark.parametrize("sampler", DISCRETE)
def test_loop_and_unrolled_forms_match_the_host_loop(sd_loops, sampler):
    """One Loop graph serves every strength (the start row is an input); the unrolled graph runs its 6
    evaluations from whatever row the strength gives (10 steps at 0.6)."""
    image, noise = _inputs((1, 4, 8, 8), seed=6)
    for strength in (0.6, 0.3, 1.0):
        kw = dict(image=image, latents=noise, strength=strength, steps=10, sampler=sampler, guidance=4.0, seed=2)
        host = sd_loops(PROMPT, **kw)
        forms = ("loop", "unrolled") if strength == 0.6 else ("loop",)
        for form in forms:
            got = sd_loops(PROMPT, loop=form, **kw)
            span = float(host.latents.max() - host.latents.min())
            db = psnr(got.latents, host.latents, data_range=span)
            print(f"{sampler} strength {strength} {form}: latents {db:.1f} dB")
            assert db >= 60.0 and psnr(got.images, host.images) >= 60.0, (form, strength)


def test_vae_encoder_gives_diffusers_posterior_mean(tiny_diffusers, sd_pipe):
    import torch
    from diffusers import AutoencoderKL

    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    ours = sd_pipe.encode_image(rgb)
    vae = AutoencoderKL.from_pretrained(tiny_diffusers / "vae")
    pixels = torch.from_numpy(rgb.astype(np.float32) / 255.0 * 2 - 1).permute(2, 0, 1)[None]
    with torch.no_grad():
        want = vae.encode(pixels).latent_dist.mean.numpy() * vae.config.scaling_factor
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() <= 2e-3 * max(1.0, float(np.abs(want).max()))  # the export's tolerance


def test_picture_in_matches_diffusers_encoding_the_same_picture(tiny_diffusers, sd_pipe):
    """An RGB picture in: our encoder's latents -> the same image as diffusers given those latents."""
    from diffusers import StableDiffusionImg2ImgPipeline
    from img2img_oracle import image_pipeline_images

    rgb = np.random.default_rng(8).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    _, noise = _inputs((1, 4, 8, 8), seed=8)
    ours = sd_pipe(PROMPT, image=rgb, latents=noise, strength=0.5, steps=8, sampler="ddim", guidance=4.0)
    ref = image_pipeline_images(StableDiffusionImg2ImgPipeline, tiny_diffusers, PROMPT, sd_pipe.encode_image(rgb),
                                noise, 8, 4.0, 0.5, sampler="ddim")
    assert psnr(ours.images, ref) >= 40.0


@pytest.mark.parametrize("folder", ["shapes-sd-onnx", "shapes-mmdit-onnx"])
def test_embedded_models_encode_a_scene_like_diffusers(folder):
    """Both shipped folders carry a VAE encoder (the MMDiT's exported from the VAE it shares with shapes-sd,
    its diffusers weights a link to shapes-sd's): the posterior mean, scaled and shifted as diffusers does."""
    import torch
    from diffusers import AutoencoderKL

    from onnxdiffusion.evaluate import scenes
    from onnxdiffusion.folder.paths import models_root

    pipe = Pipeline.from_folder(models_root() / folder)
    rgb = scenes.render(scenes.sample_scene(3, "heldout"))
    ours = pipe.encode_image(rgb)
    src = {"shapes-sd-onnx": "shapes-sd", "shapes-mmdit-onnx": "shapes-mmdit"}[folder]
    vae = AutoencoderKL.from_pretrained(models_root() / src / "vae")
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(rgb / 127.5 - 1).float().permute(2, 0, 1)[None]).latent_dist.mean.numpy()
    want = (mean - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
    assert np.abs(ours - want).max() <= 2e-3 * max(1.0, float(np.abs(want).max()))


def test_mask_overlay_keeps_the_pictures_pixels_outside_the_mask(sd_pipe):
    rgb = np.random.default_rng(9).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    mask = np.zeros((32, 32), np.uint8)
    mask[:, 16:] = 255
    plain = sd_pipe(PROMPT, image=rgb, mask=mask, strength=1.0, steps=4, seed=1)
    over = sd_pipe(PROMPT, image=rgb, mask=mask, strength=1.0, steps=4, seed=1, mask_overlay=True)
    assert np.array_equal(over.images[0][:, :16], rgb[:, :16])
    assert np.array_equal(over.images[0][:, 16:], plain.images[0][:, 16:])
    assert np.array_equal(over.latents, plain.latents)


def test_whole_graph_takes_the_image(tiny_onnx, tmp_path):
    """`compile-loop --whole`: token ids and the image latents in, the picture out; img2img by its inputs
    (start row, image_latents, image_scale; latents stay the noise) matches the host loop."""
    import shutil

    import onnxruntime as ort

    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.runtime.generation import GenerateOptions
    from onnxdiffusion.runtime.image_input import plan_start
    from onnxdiffusion.samplers.levels import cut_rows

    folder = tmp_path / "model"
    shutil.copytree(tiny_onnx, folder)
    compile_loop(folder, folder, form="loop", whole=True)
    pipe = Pipeline.from_folder(folder)
    image, noise = _inputs((1, 4, 8, 8), seed=10)
    host = pipe(PROMPT, image=image, latents=noise, strength=0.6, steps=10, sampler="dpmpp_2m", guidance=4.0)
    table = pipe.table(GenerateOptions(steps=10, sampler="dpmpp_2m"))
    start = plan_start(pipe, table, image, 0.6, 10, noise, 1, 32, 32)
    sess = ort.InferenceSession(str(folder / "sampler_loop_whole" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["image"], {
        "input_ids": pipe.tokenizer([PROMPT]), "uncond_input_ids": pipe.tokenizer([""]), "latents": noise,
        "table": cut_rows(table.rows64, start.start).astype(np.float32), "init_scale": np.array(start.noise_level, np.float32),
        "guidance": np.array(4.0, np.float32), "noise": np.zeros((1, *noise.shape), np.float32),
        "steps": np.array(table.num_steps - start.start, np.int64), "start": np.array(start.start, np.int64),
        "image_latents": image, "image_scale": np.array(start.signal, np.float32)})[0]
    assert start.start == 4 and got.shape == host.images.shape
    assert psnr(got, host.images) >= 40.0
