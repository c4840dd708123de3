"""Inpainting (issue 24): `pipe(prompt, image=..., mask=..., strength=...)` reproduces diffusers' inpaint
pipelines from the same image latents, mask and noise: latent blending after every step for regular
backbones (SD, SDXL, SD3, Flux), the 9-channel inpainting UNet's mask + masked-image latents inputs;
the Loop form matches the host loop."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

PROMPT = "a small red circle on the left"


def _mask(size: int, blur_edge: bool = False) -> np.ndarray:
    m = np.zeros((size, size), np.uint8)
    m[size // 4: 3 * size // 4, size // 8: size // 2 + 3] = 255
    return m


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.8, rng.standard_normal(shape, dtype=np.float32))


@pytest.mark.parametrize("sampler", ("ddim", "euler", "euler_a", "dpmpp_2m"))
@pytest.mark.parametrize("strength", [0.7, 1.0])
def test_sd_inpaint_blending_matches_diffusers(tiny_diffusers, tiny_onnx, sampler, strength):
    import torch
    from diffusers import StableDiffusionInpaintPipeline
    from img2img_oracle import image_pipeline_images
    from PIL import Image

    pipe = Pipeline.from_folder(tiny_onnx)
    image, noise = _inputs((1, 4, 8, 8), seed=1)
    mask = _mask(32)
    ours = pipe(PROMPT, image=image, mask=mask, latents=noise, strength=strength, steps=8, sampler=sampler,
                guidance=4.0)
    ref = image_pipeline_images(StableDiffusionInpaintPipeline, tiny_diffusers, PROMPT, image, noise, 8, 4.0, strength,
                                sampler=sampler, step_noise=ours.noise, mask=Image.fromarray(mask),
                                masked_image_latents=torch.from_numpy(image), height=32, width=32)
    got = psnr(ours.images, ref)
    print(f"sd inpaint {sampler} {strength}: {got:.1f} dB")
    assert got >= 40.0
    plain = pipe(PROMPT, image=image, latents=noise, strength=strength, steps=8, sampler=sampler, guidance=4.0)
    assert psnr(plain.images, ours.images) < 40.0  # the mask matters


@pytest.fixture(scope="module")
def inpaint_pair(tmp_path_factory):
    from img2img_oracle import build_tiny_inpaint

    from onnxdiffusion.export import export_pipeline

    d = tmp_path_factory.mktemp("inpaint9")
    src = build_tiny_inpaint(d)
    export_pipeline(src, d / "onnx", progress=False)
    return src, d / "onnx"


@pytest.mark.parametrize("sampler", ("ddim", "euler", "dpmpp_2m"))
def test_sd_inpainting_unet_matches_diffusers(inpaint_pair, sampler):
    """The 9-channel UNet: mask and masked-image latents (our VAE encoder on the masked picture) as inputs."""
    import torch
    from diffusers import StableDiffusionInpaintPipeline
    from img2img_oracle import image_pipeline_images
    from PIL import Image

    src, folder = inpaint_pair
    pipe = Pipeline.from_folder(folder)
    assert pipe.backbone_sample_channels() == 9
    rgb = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    mask = _mask(32)
    _, noise = _inputs((1, 4, 8, 8), seed=2)
    ours = pipe(PROMPT, image=rgb, mask=mask, latents=noise, strength=1.0, steps=8, sampler=sampler, guidance=4.0)
    from onnxdiffusion.runtime.image_input import image_pixels

    masked = pipe.encode_pixels(image_pixels(rgb, 32, 32) * (np.asarray(mask)[None, None] < 128))
    ref = image_pipeline_images(StableDiffusionInpaintPipeline, src, PROMPT, pipe.encode_image(rgb), noise, 8, 4.0, 1.0,
                                sampler=sampler, mask=Image.fromarray(mask),
                                masked_image_latents=torch.from_numpy(masked), height=32, width=32)
    got = psnr(ours.images, ref)
    print(f"sd 9-channel inpaint {sampler}: {got:.1f} dB")
    assert got >= 40.0
