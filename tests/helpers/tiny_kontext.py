"""A tiny random-weight FluxKontextPipeline, built offline, and the pictures it edits.

Its config differs from diffusers' own Kontext test (tests/pipelines/flux/test_pipeline_flux_kontext.py): two
double blocks and one single block, three heads of 8, rope axes (2, 2, 4), a VAE of factor 2 with 4 latent
channels, Kontext-dev's scheduler (dynamic shift). The reference is encoded at the nearest preferred Kontext
resolution scaled by factor/8 (families/flux_kontext.py); REF_SIZE is one of them, so diffusers' own resize
(`_auto_resize=False`) keeps it as is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REF_SIZE = (168, 392)  # (height, width): the preferred (width 1568, height 672) at factor 2: 98 x 42 tokens


def build_tiny_kontext(folder: Path, vae_attention: bool = True) -> Path:
    """`vae_attention=False`: a VAE without the mid-block attention (the browser page's test: onnxruntime-web's WASM
    build cannot run that attention over the 16384 latent tokens of a Kontext reference picture)."""
    import torch
    from diffusers import AutoencoderKL, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    from tiny_families import _clip, flux_scheduler, t5_tokenizer

    torch.manual_seed(1)
    tokenizer, text_encoder = _clip(folder, 16, 24)
    tokenizer_2 = t5_tokenizer(12)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=24, d_kv=8, d_ff=29, num_layers=1, num_heads=3,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=3, joint_attention_dim=24, pooled_projection_dim=24, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    _sharpen(transformer)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611, mid_block_add_attention=vae_attention,
    )
    pipe = FluxKontextPipeline(scheduler=flux_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                               text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    out = folder / ("kontext" if vae_attention else "kontext_no_vae_attention")
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _sharpen(transformer) -> None:
    """Every linear weight drawn at 0.6 / sqrt(fan_in) (diffusers' init is ~0.6x that for these widths, and the
    zero-initialised output modulation leaves the reference tokens little say): the picture then visibly
    steers the image, so a wrong reference (ids, scaling, packing) fails the parity test."""
    import torch

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in transformer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (1.5 / m.in_features ** 0.5))


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth random picture (H, W, 3) uint8: shapes a VAE keeps, not white noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width])[:, None, None]
    chans = [np.sin(2 * np.pi * (rng.uniform(0.5, 2) * x + rng.uniform(0.5, 2) * y) + rng.uniform(0, 6)) for _ in range(3)]
    return np.clip(np.round(127.5 + 110 * np.stack(chans, axis=-1)), 0, 255).astype(np.uint8)
