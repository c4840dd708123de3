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
    from diffusers import FluxKontextPipeline

    from tiny_families import FluxSizes, flux_components

    sizes = FluxSizes(seed=1, width=24, t5_length=12, t5_ff=29, t5_layers=1, t5_heads=3, blocks=2, single_blocks=1,
                      head_dim=8, heads=3, axes=(2, 2, 4), vae_shift=0.1159, vae_scale=0.3611,
                      vae_attention=vae_attention)
    pipe = FluxKontextPipeline(**flux_components(folder, sizes, prepare=_sharpen))
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
