"""Inpainting on the last two flow cases of issue 24: Qwen-Image by latent blending after every step
(`QwenImageInpaintPipeline`), and Flux Fill, a dedicated backbone that takes the packed masked-image
latents and the packed 8x8 mask as extra channels of every token (`FluxFillPipeline`, no blending);
each from the same picture, mask and noise as diffusers, and the Loop form against the host loop."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.families.latents import pack_patches
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a small red circle on the left"


def _mask(size: int) -> np.ndarray:
    m = np.zeros((size, size), np.uint8)
    m[size // 4: 3 * size // 4, size // 8: size // 2 + 3] = 255
    return m


def _picture_and_noise(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), rng.standard_normal(shape, dtype=np.float32)


def _loop_matches_host(folder, tmp_path, kwargs_list) -> None:
    from onnxdiffusion.loopgraph.compile import compile_loop

    copy = tmp_path / "loop"
    shutil.copytree(folder, copy)
    compile_loop(copy, copy, form="loop")
    pipe = Pipeline.from_folder(copy)
    for kw in kwargs_list:
        host = pipe(PROMPT, **kw)
        loop = pipe(PROMPT, loop="loop", **kw)
        span = float(host.latents.max() - host.latents.min())
        db = psnr(loop.latents, host.latents, data_range=span)
        print(f"strength {kw['strength']} loop vs host: {db:.1f} dB")
        assert db >= 60.0 and psnr(loop.images, host.images) >= 60.0, kw['strength']


# -- Qwen-Image: latent blending -----------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_with_encoder(tiny_qwenimage_enc_onnx):
    """The tiny Qwen-Image folder as export_family makes it, plus its VAE encoder (conftest: once per run)."""
    return tiny_qwenimage_enc_onnx


@pytest.mark.parametrize("sampler,strength,true_cfg", [("flow_euler", 0.8, 4.0), ("dpmpp_2m", 1.0, 4.0),
                                                       ("flow_euler", 1.0, 1.0)])
def test_qwenimage_inpaint_matches_diffusers(tiny_qwenimage_diffusers, qwen_with_encoder, sampler, strength, true_cfg):
    """The picture in on both sides (diffusers' inpaint pipeline multiplies the picture by the mask before it
    encodes, so it takes no latents for it); the mask's kept region is reset each step to the image latents
    noised to the next sigma with the first noise."""
    from diffusers import QwenImageInpaintPipeline
    from img2img_oracle import image_pipeline_images
    from PIL import Image
    from test_img2img import _flow_scheduler

    pipe = Pipeline.from_folder(qwen_with_encoder)
    rgb, noise = _picture_and_noise((1, 4, 8, 8), seed=21)
    mask = _mask(32)
    negative = "blurry" if true_cfg > 1 else None
    kw = dict(image=rgb, mask=mask, latents=pack_patches(noise), strength=strength, steps=6, sampler=sampler,
              height=32, width=32)
    ours = pipe(PROMPT, negative_prompt=negative, guidance=true_cfg, **kw)
    ref = image_pipeline_images(QwenImageInpaintPipeline, tiny_qwenimage_diffusers, PROMPT, Image.fromarray(rgb),
                                noise, 6, None, strength, scheduler=_flow_scheduler(sampler),
                                mask=Image.fromarray(mask), height=32, width=32, negative_prompt=negative,
                                true_cfg_scale=true_cfg)
    got = psnr(ours.images, ref)
    print(f"qwenimage inpaint {sampler} {strength} cfg {true_cfg}: {got:.1f} dB")
    assert got >= 40.0
    plain = pipe(PROMPT, negative_prompt=negative, guidance=true_cfg, **{k: v for k, v in kw.items() if k != "mask"})
    assert psnr(plain.images, ours.images) < 40.0  # the mask matters


def test_qwenimage_inpaint_loop_matches_the_host_loop(qwen_with_encoder, tmp_path):
    rgb, _ = _picture_and_noise((1,), seed=22)
    _loop_matches_host(qwen_with_encoder, tmp_path, [
        dict(image=rgb, mask=_mask(32), strength=s, steps=6, sampler="dpmpp_2m", guidance=4.0,
             negative_prompt="blurry", height=32, width=32, seed=5) for s in (0.7, 1.0)])


# -- Flux Fill: a dedicated backbone ----------------------------------------------------------------

def build_tiny_flux_fill(flux_src, folder):
    """The tiny Flux pipeline with a Flux Fill transformer: in_channels = 16 packed latents + 16 packed
    masked-image latents + 16 (the 2x2-packed 2x2 pixel mask of each latent pixel; 384 on the real model's
    64 + 64 + 256), out_channels = 16."""
    import torch
    from diffusers import FluxFillPipeline, FluxPipeline, FluxTransformer2DModel

    base = FluxPipeline.from_pretrained(flux_src, local_files_only=True)
    config = {k: v for k, v in base.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(3)
    transformer = FluxTransformer2DModel(**{**config, "in_channels": 48, "out_channels": 16})
    pipe = FluxFillPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                            tokenizer=base.tokenizer, text_encoder_2=base.text_encoder_2, tokenizer_2=base.tokenizer_2,
                            transformer=transformer)
    pipe.save_pretrained(folder / "fill", safe_serialization=True)
    return folder / "fill"


@pytest.fixture(scope="module")
def flux_fill(tiny_flux_diffusers, tmp_path_factory):
    from onnxdiffusion.export import ExportOptions, export_pipeline

    d = tmp_path_factory.mktemp("flux_fill")
    src = build_tiny_flux_fill(tiny_flux_diffusers, d)
    names = ("text_encoder", "text_encoder_2", "transformer", "vae_decoder", "vae_encoder")
    export_pipeline(src, d / "onnx", ExportOptions(components=names, default_size=32), progress=False)
    return src, d / "onnx"


@pytest.mark.parametrize("sampler,strength,guidance", [("flow_euler", 1.0, 30.0), ("dpmpp_2m", 1.0, 30.0),
                                                       ("flow_euler", 0.7, 10.0)])
def test_flux_fill_matches_diffusers(flux_fill, sampler, strength, guidance):
    """The masked picture's latents and the packed pixel mask ride along every step; no blending."""
    from diffusers import FluxFillPipeline
    from img2img_oracle import image_pipeline_images
    from PIL import Image
    from test_img2img import _flow_scheduler

    src, folder = flux_fill
    pipe = Pipeline.from_folder(folder)
    assert pipe.backbone_extra_channels() == 32
    rgb, noise = _picture_and_noise((1, 4, 16, 16), seed=31)
    mask = _mask(32)
    ours = pipe(PROMPT, image=rgb, mask=mask, latents=pack_patches(noise), strength=strength, steps=6,
                sampler=sampler, guidance=guidance, height=32, width=32)
    ref = image_pipeline_images(FluxFillPipeline, src, PROMPT, Image.fromarray(rgb), noise, 6, guidance, strength,
                                scheduler=_flow_scheduler(sampler), mask=Image.fromarray(mask), height=32, width=32,
                                max_sequence_length=pipe.info["max_lengths"]["text_encoder_2"])
    got = psnr(ours.images, ref)
    print(f"flux fill {sampler} {strength} guidance {guidance}: {got:.1f} dB")
    assert got >= 40.0
    other = np.zeros_like(mask)
    other[:, 16:] = 255
    moved = pipe(PROMPT, image=rgb, mask=other, latents=pack_patches(noise), strength=strength, steps=6,
                 sampler=sampler, guidance=guidance, height=32, width=32)
    assert psnr(moved.images, ours.images) < 40.0  # the mask matters


def test_flux_fill_needs_a_mask_and_the_picture(flux_fill):
    from onnxdiffusion.errors import UserError

    pipe = Pipeline.from_folder(flux_fill[1])
    rgb, _ = _picture_and_noise((1,), seed=32)
    with pytest.raises(UserError, match="inpainting backbone"):
        pipe(PROMPT, steps=2, height=32, width=32)
    with pytest.raises(UserError, match="needs the picture itself"):
        pipe(PROMPT, image=np.zeros((1, 4, 16, 16), np.float32), mask=_mask(32), steps=2, height=32, width=32)


def test_flux_fill_loop_matches_the_host_loop(flux_fill, tmp_path):
    rgb, _ = _picture_and_noise((1,), seed=33)
    _loop_matches_host(flux_fill[1], tmp_path, [
        dict(image=rgb, mask=_mask(32), strength=s, steps=6, sampler="dpmpp_2m", guidance=30.0, height=32, width=32,
             seed=6) for s in (1.0, 0.75)])


def test_flux_blend_loop_matches_the_host_loop(tiny_flux_onnx, tmp_path):
    """A regular Flux backbone blends packed tokens in the Loop graph too (its state's width from the
    backbone's output, as Flux Fill's wider sample needs)."""
    image = np.random.default_rng(34).standard_normal((1, 4, 16, 16), dtype=np.float32)
    _loop_matches_host(tiny_flux_onnx, tmp_path, [
        dict(image=image, mask=_mask(32), strength=s, steps=6, sampler="dpmpp_2m", guidance=3.5, height=32, width=32,
             seed=7) for s in (1.0, 0.6)])


@pytest.mark.parametrize("in_channels,out_channels,ok", [(16, None, True), (48, 16, True), (40, 16, False),
                                                         (48, None, False)])
def test_flux_transformer_widths_are_checked(in_channels, out_channels, ok):
    """Regular (4C) or Fill (4C + 4C + 4f^2) token widths, the output always the packed latents': anything else
    is one error line at export and load."""
    from onnxdiffusion.errors import UserError
    from onnxdiffusion.families import get_family

    configs = {"transformer": {"in_channels": in_channels, "out_channels": out_channels, "joint_attention_dim": 32,
                               "pooled_projection_dim": 32},
               "text_encoder": {"hidden_size": 32}, "text_encoder_2": {"d_model": 32},
               "vae": {"latent_channels": 4, "block_out_channels": [8, 16], "scaling_factor": 1.5},
               "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler"}}
    if ok:
        info = get_family("flux").pipeline_info(configs)
        assert info.get("backbone_in_channels", 16) == in_channels
    else:
        with pytest.raises(UserError, match="in_channels|out_channels"):
            get_family("flux").pipeline_info(configs)
