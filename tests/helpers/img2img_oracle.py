"""diffusers' Img2Img / Inpaint pipelines run on our image latents and noise (the img2img parity oracle).

diffusers' image pipelines draw the starting noise themselves (`randn_tensor` in the pipeline module)
and take no `latents` for it: the helper hands them ours, as family_pipelines.diffusers_images does
for ancestral noise."""

from __future__ import annotations

import sys

import numpy as np


def image_pipeline_images(cls, folder, prompt, image_latents, noise, steps, guidance, strength, sampler=None,
                          step_noise=None, scheduler=None, mask=None, latents_out=False, **extra) -> np.ndarray:
    """uint8 (B, H, W, 3) from diffusers' `cls` (e.g. StableDiffusionImg2ImgPipeline) loaded from `folder`
    (`latents_out`: its final latents instead). `image_latents`: scaled latents, or a PIL picture."""
    import diffusers
    import torch

    from family_pipelines import SCHEDULERS

    pipe = cls.from_pretrained(folder, local_files_only=True)
    if scheduler is not None:
        pipe.scheduler = scheduler(pipe)
    elif sampler is not None:
        cls_name, kw = SCHEDULERS[sampler]
        pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **kw)
    if not hasattr(pipe.scheduler, "scale_noise"):
        _give_scale_noise(pipe.scheduler)
    pipe.set_progress_bar_config(disable=True)
    module = sys.modules[type(pipe).__module__]
    patched = [(module, module.randn_tensor)]
    first = torch.from_numpy(noise)

    def pipeline_noise(shape, *a, **k):  # the pipeline's one draw: our noise, in the shape it asks
        return first.reshape(shape)

    module.randn_tensor = pipeline_noise
    if step_noise is not None:
        import diffusers.schedulers.scheduling_euler_ancestral_discrete as sched_mod

        draws = iter(torch.from_numpy(n) for n in step_noise)
        patched.append((sched_mod, sched_mod.randn_tensor))
        sched_mod.randn_tensor = lambda *a, **k: next(draws)
    kw = dict(mask_image=mask) if mask is not None else {}
    # a picture (not latents): diffusers encodes it; its posterior's mean, as ours does (not a random sample)
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    sample = DiagonalGaussianDistribution.sample
    DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mean
    image = torch.from_numpy(image_latents) if isinstance(image_latents, np.ndarray) and image_latents.dtype.kind == "f" \
        else image_latents
    try:
        out = pipe(prompt, image=image, strength=strength, num_inference_steps=steps, guidance_scale=guidance,
                   output_type="latent" if latents_out else "np", **kw, **extra).images
    finally:
        DiagonalGaussianDistribution.sample = sample
        for mod, fn in patched:
            mod.randn_tensor = fn
    if latents_out:
        return out.numpy()
    return (out * 255).round().astype(np.uint8)


def _give_scale_noise(scheduler) -> None:
    """diffusers' DPMSolverMultistepScheduler has no `scale_noise`, which the flow img2img pipelines
    (SD3, Flux, Qwen-Image) call, so they cannot run it as shipped; the oracle gives it
    FlowMatchEulerDiscreteScheduler's: sigma * noise + (1 - sigma) * x at the begin index, or after a step (an
    inpaint pipeline's blend) at the step index, the next row's sigma."""
    import types

    def scale_noise(self, sample, timestep, noise):
        at = self.step_index if self.step_index is not None else self.begin_index
        sigma = self.sigmas[at if at is not None else 0]
        return sigma * noise + (1.0 - sigma) * sample

    scheduler.scale_noise = types.MethodType(scale_noise, scheduler)


def build_tiny_inpaint(folder):
    """The tiny SD pipeline (conftest) with a 9-channel inpainting UNet, as StableDiffusionInpaintPipeline."""
    import torch
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline, UNet2DConditionModel

    from conftest import build_tiny_pipeline

    src = build_tiny_pipeline(folder / "base")
    base = StableDiffusionPipeline.from_pretrained(src, local_files_only=True)
    torch.manual_seed(1)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=9, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
    )
    pipe = StableDiffusionInpaintPipeline(vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer,
                                          unet=unet, scheduler=base.scheduler, safety_checker=None,
                                          feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(folder / "inpaint", safe_serialization=True)
    return folder / "inpaint"
