"""Tiny random-weight SDXL and SD3 pipelines built offline (configs shrunk like diffusers' own tests),
and a helper that runs the diffusers pipeline on our initial latents (the parity oracle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

def clip_tokenizer(folder: Path, pad_token: str | None = None):
    """A CLIP tokenizer over the scene vocabulary, 16 tokens (SDXL's second pads with "!")."""
    import tokenizer_build

    from onnxdiffusion.evaluate import scenes

    return tokenizer_build.clip_tokenizer(folder, scenes.vocabulary(), 16, pad_token)


def t5_tokenizer(folder: Path, max_length: int = 24):
    """A T5 (Unigram) tokenizer over the scene vocabulary: <pad>=0, </s>=1, <unk>=2."""
    import tokenizer_build

    from onnxdiffusion.evaluate import scenes

    return tokenizer_build.t5_tokenizer(folder, scenes.vocabulary(), max_length)


SCHEDULERS = {
    # --sampler X runs X's class as from_config(folder config): a config naming no clip_sample gets DDIM's
    # default (True) on both sides now that clip_sample is reproduced
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
}


def _clip_config(tokenizer, hidden: int = 32, **extra):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra,
    )


def _vae(latent_channels: int = 4, **extra):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1, norm_num_groups=8, sample_size=32, **extra,
    )


def build_tiny_sdxl(folder: Path) -> Path:
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    tok1 = clip_tokenizer(folder / "_tok1")
    tok2 = clip_tokenizer(folder / "_tok2", pad_token="!")
    te1 = CLIPTextModel(_clip_config(tok1, 32))
    te2 = CLIPTextModelWithProjection(_clip_config(tok2, 32, projection_dim=16))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=6 * 8 + 16,
        cross_attention_dim=64, norm_num_groups=8,
    )
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=_vae(), text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2,
                                     unet=unet, scheduler=scheduler, add_watermarker=False)
    pipe.save_pretrained(folder / "diffusers", safe_serialization=True)
    return folder / "diffusers"


def build_tiny_sd3(folder: Path, with_t5: bool = True) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tok1 = clip_tokenizer(folder / "_tok1")
    tok2 = clip_tokenizer(folder / "_tok2", pad_token="!")
    te1 = CLIPTextModelWithProjection(_clip_config(tok1, 32, projection_dim=32))
    te2 = CLIPTextModelWithProjection(_clip_config(tok2, 32, projection_dim=32))
    tok3 = te3 = None
    if with_t5:
        tok3 = t5_tokenizer(folder / "_tok3")
        te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=80, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                      relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=80, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16, pos_embed_max_size=16,
    )
    vae = _vae(16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1,
                                    tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2, text_encoder_3=te3,
                                    tokenizer_3=tok3)
    pipe.save_pretrained(folder / "diffusers", safe_serialization=True)
    return folder / "diffusers"


def diffusers_images(folder, prompt, latents, steps, guidance, sampler=None, noise=None, negative=None,
                     image_size=None, load_kwargs=None, **extra) -> np.ndarray:
    """The diffusers pipeline at `folder` (its own scheduler, or `sampler`'s class) from our latents, as uint8."""
    import diffusers
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, **(load_kwargs or {}))
    if sampler is not None:
        cls_name, kw = SCHEDULERS[sampler]
        pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **kw)
    pipe.set_progress_bar_config(disable=True)
    original = None
    if noise is not None:
        # diffusers draws ancestral noise itself: hand it ours, step by step
        import diffusers.schedulers.scheduling_euler_ancestral_discrete as mod

        draws = iter(torch.from_numpy(n) for n in noise)
        original = mod.randn_tensor
        mod.randn_tensor = lambda *a, **k: next(draws)
    h, w = image_size
    try:
        out = pipe(prompt, negative_prompt=negative, latents=torch.from_numpy(latents), num_inference_steps=steps,
                   guidance_scale=guidance, output_type="np", height=h, width=w, **extra).images
    finally:
        if original is not None:
            mod.randn_tensor = original
    return (out * 255).round().astype(np.uint8)
