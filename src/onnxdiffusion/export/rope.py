"""Rotary position embeddings in real arithmetic, for export.

Qwen-Image computes its rotary table as complex numbers (`torch.polar`) and rotates q/k with a
complex multiply (`view_as_complex`); the TorchScript exporter has no complex dtype, so the
rotation is rewritten here as the same computation on (cos, sin) pairs. The table is also made a
function of position ids (one row of (frame, row, column) per token, like Flux's `img_ids` /
`txt_ids`) instead of Python ints, so image and text lengths stay dynamic axes of the graph; the
ids are plain numpy at run time.
"""

from __future__ import annotations

import torch


def axis_inv_freqs(axes_dim: tuple[int, ...], theta: float) -> torch.Tensor:
    """1 / theta^(2k/d) per axis, concatenated: the angle of token p on pair k is ids[p, axis(k)] * inv[k].

    Computed in float32 like Qwen's `rope_params` so the tables agree to rounding."""
    return torch.cat([1.0 / torch.pow(theta, torch.arange(0, d, 2).to(torch.float32).div(d)) for d in axes_dim])


def cos_sin_from_ids(ids: torch.Tensor, axes_dim: tuple[int, ...], inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [S, n_axes] -> (cos, sin), each [S, sum(axes_dim) // 2] (one entry per rotated pair)."""
    pos = torch.cat([ids[:, i:i + 1].expand(-1, d // 2) for i, d in enumerate(axes_dim)], dim=1)
    angle = pos.to(torch.float32) * inv_freq
    return torch.cos(angle), torch.sin(angle)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with (real, imag) interleaved on D, times exp(i * angle): the real form of
    `view_as_real(view_as_complex(x) * polar(1, angle))`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).to(x.dtype)


def qwen_image_ids(frames: int, height: int, width: int, scale_rope: bool) -> torch.Tensor:
    """The (frame, row, column) ids Qwen's `QwenEmbedRope._compute_video_freqs` indexes its table
    with (centred rows/columns when `scale_rope`): a torch twin of the run-time numpy function,
    used to check the rewrite."""
    def axis(n: int) -> torch.Tensor:
        if scale_rope:
            return torch.cat([torch.arange(-(n - n // 2), 0), torch.arange(0, n // 2)])
        return torch.arange(n)

    f = torch.arange(frames).view(frames, 1, 1).expand(frames, height, width)
    h = axis(height).view(1, height, 1).expand(frames, height, width)
    w = axis(width).view(1, 1, width).expand(frames, height, width)
    return torch.stack([f, h, w], dim=-1).reshape(-1, 3).to(torch.float32)
