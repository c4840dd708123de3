"""What the whole-pipeline graph (`compile-loop --whole`) does at its two ends where a family differs from
Stable Diffusion's plain ids -> encoder -> combine and latents * scale + shift -> decoder, declared as data or
written once for numpy and ONNX:

  - the text side of an LLM encoder read under its padding mask: each row keeps its unmasked tokens (minus the
    chat template's first `drop`), the rows zero-padded to the longest rounded up to `multiple`, with a float mask
    (`kept_tokens`: the host's numpy form here, `loopgraph/whole.GraphOps.kept_tokens` its ONNX twin);
  - the decoder's input (`DecodeFeed`): per-channel affine maps on the packed tokens or the unpacked latents, and
    a frames axis for a video VAE.

numpy only (run-time code, no onnx here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pad_rows(rows: list[np.ndarray], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Variable-length [n_i, D] rows -> ([B, L, D] zero-padded, [B, L] float mask)."""
    length = max(r.shape[0] for r in rows) if length is None else length
    out = np.zeros((len(rows), length, rows[0].shape[-1]), np.float32)
    mask = np.zeros((len(rows), length), np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        mask[i, :len(r)] = 1.0
    return out, mask


def kept_tokens(states: np.ndarray, mask: np.ndarray, drop: int = 0, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """An encoder's (B, L, D) states under its (B, L) mask -> each row's kept tokens after the first `drop`,
    zero-padded to the longest row rounded up to a multiple of `multiple` (B, S, D), and their (B, S) float mask."""
    rows = [h[m.astype(bool)][drop:] for h, m in zip(states, mask)]
    longest = max(len(r) for r in rows)
    return pad_rows(rows, -(-longest // multiple) * multiple)


@dataclass(frozen=True)
class DecodeFeed:
    """The final sampler state -> the VAE decoder's input, as the whole graph builds it (the family's
    `decoder_feed`, whose twin this is; a test compares the two through the image). In order: `token_mul`,
    `token_add` per channel of the packed tokens' last axis (before unpacking), then `x * scale + shift`, then
    `channel_div`, `channel_add` per latent channel (axis 1, after unpacking), then a frames axis at 2 when
    `frames` (a video VAE: one frame in, its one frame out)."""

    scale: float = 1.0
    shift: float = 0.0
    token_mul: tuple[float, ...] | None = None
    token_add: tuple[float, ...] | None = None
    channel_div: tuple[float, ...] | None = None
    channel_add: tuple[float, ...] | None = None
    frames: bool = False
