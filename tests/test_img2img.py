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
