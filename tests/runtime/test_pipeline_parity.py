"""The exported ONNX pipeline against diffusers' PyTorch pipeline: same prompt, latents, sampler, steps."""

import numpy as np
import pytest

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

SCHEDULERS = {
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
}


def diffusers_images(folder, sampler, prompt, latents, steps, guidance, noise=None, negative=None):
    import diffusers
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    cls_name, extra = SCHEDULERS[sampler]
    pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **extra)
    pipe.set_progress_bar_config(disable=True)
    if noise is not None:
        # diffusers draws ancestral noise itself: hand it ours, step by step, to compare like with like
        import diffusers.schedulers.scheduling_euler_ancestral_discrete as mod

        draws = iter(torch.from_numpy(n) for n in noise)
        original = mod.randn_tensor
        mod.randn_tensor = lambda *a, **k: next(draws)
    try:
        out = pipe(
            prompt, negative_prompt=negative, latents=torch.from_numpy(latents), num_inference_steps=steps,
            guidance_scale=guidance, output_type="np", height=latents.shape[2] * 4, width=latents.shape[3] * 4,
        ).images
    finally:
        if noise is not None:
            mod.randn_tensor = original
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("sampler", ["ddim", "euler", "euler_a", "dpmpp_2m"])
def test_image_parity_epsilon(tiny_diffusers, tiny_onnx, sampler):
    pipe = Pipeline.from_folder(tiny_onnx)
    ours = pipe("a red circle on the left", steps=8, sampler=sampler, guidance=5.0, seed=3, batch=2)
    ref = diffusers_images(tiny_diffusers, sampler, ["a red circle on the left"] * 2, ours.init_latents, 8, 5.0, ours.noise)
    assert ref.shape == ours.images.shape
    assert psnr(ours.images, ref) >= 40.0


@pytest.mark.parametrize("sampler", ["ddim", "dpmpp_2m", "euler"])
def test_image_parity_v_prediction(tiny_v_diffusers, tiny_v_onnx, sampler):
    pipe = Pipeline.from_folder(tiny_v_onnx)
    ours = pipe("a blue star", negative_prompt="a green ring", steps=6, sampler=sampler, guidance=3.0, seed=1)
    ref = diffusers_images(tiny_v_diffusers, sampler, "a blue star", ours.init_latents, 6, 3.0, negative="a green ring")
    assert psnr(ours.images, ref) >= 40.0


def test_tokenizer_matches_transformers(tiny_diffusers, tiny_onnx):
    from transformers import CLIPTokenizer

    ref = CLIPTokenizer.from_pretrained(tiny_diffusers / "tokenizer")
    pipe = Pipeline.from_folder(tiny_onnx)
    prompts = ["a small red circle above a blue star", "On the LEFT,  a purple ring!", "", "zebra 123"]
    want = ref(prompts, padding="max_length", max_length=ref.model_max_length, truncation=True).input_ids
    np.testing.assert_array_equal(pipe.tokenizer(prompts), np.array(want))


def test_overlong_prompt_is_truncated_with_warning(tiny_diffusers, tiny_onnx):
    from transformers import CLIPTokenizer

    ref = CLIPTokenizer.from_pretrained(tiny_diffusers / "tokenizer")
    pipe = Pipeline.from_folder(tiny_onnx)
    long = " ".join(["a red circle"] * 20)
    with pytest.warns(UserWarning, match="truncated"):
        ids = pipe.tokenizer([long])
    want = ref([long], padding="max_length", max_length=ref.model_max_length, truncation=True).input_ids
    np.testing.assert_array_equal(ids, np.array(want))


def test_generation_is_deterministic_and_seeded(tiny_onnx):
    pipe = Pipeline.from_folder(tiny_onnx)
    a = pipe("a red circle", steps=3, seed=7)
    b = pipe("a red circle", steps=3, seed=7)
    c = pipe("a red circle", steps=3, seed=8)
    np.testing.assert_array_equal(a.images, b.images)
    assert not np.array_equal(a.latents, c.latents)
    d = pipe("a red circle", steps=3, latents=a.init_latents)
    np.testing.assert_array_equal(a.latents, d.latents)


def test_iter_generate_yields_every_step(tiny_onnx):
    from onnxdiffusion.runtime import GenerationResult, StepEvent

    pipe = Pipeline.from_folder(tiny_onnx)
    events = list(pipe.iter_generate("a red circle", steps=4, sampler="euler"))
    assert [e.step for e in events[:-1]] == [0, 1, 2, 3]
    assert all(isinstance(e, StepEvent) for e in events[:-1])
    assert isinstance(events[-1], GenerationResult)
    np.testing.assert_array_equal(events[-2].latents, events[-1].latents)
