"""diffusers' Img2Img / Inpaint pipelines run on our image latents and noise (the img2img parity oracle).

diffusers' image pipelines draw the starting noise themselves (`randn_tensor` in the pipeline module)
and take no `latents` for it: the helper hands them ours, as family_pipelines.diffusers_images does
for ancestral noise."""

from __future__ import annotations

import sys

import numpy as np


def image_pipeline_images(cls, folder, prompt, image_latents, noise, steps, guidance, strength, sampler=None,
                          step_noise=None, scheduler=None, mask=None, **extra) -> np.ndarray:
    """uint8 (B, H, W, 3) from diffusers' `cls` (e.g. StableDiffusionImg2ImgPipeline) loaded from `folder`."""
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
    try:
        out = pipe(prompt, image=torch.from_numpy(image_latents), strength=strength, num_inference_steps=steps,
                   guidance_scale=guidance, output_type="np", **kw, **extra).images
    finally:
        for mod, fn in patched:
            mod.randn_tensor = fn
    return (out * 255).round().astype(np.uint8)


def _give_scale_noise(scheduler) -> None:
    """diffusers' DPMSolverMultistepScheduler has no `scale_noise`, which the flow img2img pipelines
    (SD3, Flux, Qwen-Image) call, so they cannot run it as shipped; the oracle gives it
    FlowMatchEulerDiscreteScheduler's: sigma * noise + (1 - sigma) * x at the begin index."""
    import types

    def scale_noise(self, sample, timestep, noise):
        sigma = self.sigmas[self.begin_index if self.begin_index is not None else 0]
        return sigma * noise + (1.0 - sigma) * sample

    scheduler.scale_noise = types.MethodType(scale_noise, scheduler)
