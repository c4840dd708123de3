"""Classifier-free guidance in numpy.

The prediction-type adapter (eps / v -> x0) is not here: it is folded into the
``p, q`` columns of each sampler table so no sampler ever branches on it.
Batch order is [uncond, cond], as in diffusers pipelines.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def cfg_combine(out_uncond: np.ndarray, out_cond: np.ndarray, guidance_scale: float,
                rescale: bool = False) -> np.ndarray:
    """u + g (c - u); `rescale`: then scaled to the conditional output's norm over the last axis,
    per token (Qwen-Image's true CFG)."""
    out = out_uncond + np.float32(guidance_scale) * (out_cond - out_uncond)
    if rescale:
        out = out * (np.linalg.norm(out_cond, axis=-1, keepdims=True) / np.linalg.norm(out, axis=-1, keepdims=True))
    return out


def cfg_batch(x: np.ndarray) -> np.ndarray:
    """Stack latents twice along the batch axis: first half uncond, second half cond."""
    return np.concatenate([x, x], axis=0)


def cfg_split(out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if out.shape[0] % 2:
        raise ValueError(f"guided batch must have an even batch size, got {out.shape[0]}")
    half = out.shape[0] // 2
    return out[:half], out[half:]


def guided(batched_fn: Callable[[np.ndarray, float], np.ndarray],
           guidance_scale: float) -> Callable[[np.ndarray, float], np.ndarray]:
    """Wrap ``batched_fn(x2, t)`` (doubled batch in, doubled batch out) as a guided ``model_fn(x, t)``."""

    def model_fn(x: np.ndarray, t: float) -> np.ndarray:
        return cfg_combine(*cfg_split(batched_fn(cfg_batch(x), t)), guidance_scale)

    return model_fn
