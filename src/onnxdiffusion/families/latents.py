"""Token layouts of the transformer backbones, in numpy: patch packing and rotary position ids.

Flux and Qwen-Image both feed their transformer 2x2 latent patches as tokens (channels-last within
a patch) and both rotate q/k by (frame, row, column) position ids; they differ only in whether rows
and columns are centred on zero and where text positions start, which the family passes in.
"""

from __future__ import annotations

import numpy as np


def pack_patches(latents: np.ndarray, patch: int = 2) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/p)(W/p), C*p*p] (diffusers' `_pack_latents`)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // patch, patch, w // patch, patch).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(b, (h // patch) * (w // patch), c * patch * patch))


def unpack_patches(tokens: np.ndarray, height: int, width: int, patch: int = 2) -> np.ndarray:
    """[B, (H/p)(W/p), C*p*p] -> [B, C, H, W] for latent height/width H, W (diffusers' `_unpack_latents`)."""
    b, _, d = tokens.shape
    c = d // (patch * patch)
    x = tokens.reshape(b, height // patch, width // patch, c, patch, patch).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(x.reshape(b, c, height, width))


def _axis(n: int, centred: bool) -> np.ndarray:
    # centred: -(n - n//2) .. n//2 - 1, as Qwen's rope table indexes its negative/positive halves
    return np.arange(n) - (n - n // 2) if centred else np.arange(n)


def image_ids(rows: int, cols: int, centred: bool = False, frame: int = 0) -> np.ndarray:
    """(frame, row, column) per token, rows outer: [rows*cols, 3] float32."""
    r, c = np.meshgrid(_axis(rows, centred), _axis(cols, centred), indexing="ij")
    ids = np.stack([np.full(r.shape, frame), r, c], axis=-1).reshape(-1, 3)
    return ids.astype(np.float32)


def channel_axis(rank: int) -> int:
    """Where a backbone sample's channels are: axis 1 of NCHW latents, the last of packed tokens (B, L, D)."""
    return 1 if rank == 4 else rank - 1
