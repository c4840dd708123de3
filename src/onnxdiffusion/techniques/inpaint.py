"""Inpainting with a regular backbone: the kept region blended back after every step (its Loop twin is
inpaint_graph.py's blend_step, fed the image inputs by runtime/sampling_graph.py)."""

from __future__ import annotations

import numpy as np

from .host_base import HostTechnique

NAME = "inpaint"


class BlendHost(HostTechnique):
    name = NAME

    def __init__(self, start, noise0: np.ndarray):
        self.start, self.noise0 = start, noise0

    def after_step(self):
        return blend_step(self.start, self.noise0)


def blend_step(start, noise0: np.ndarray):
    """after_step for inpainting with a regular backbone: x = keep * target_i + (1 - keep) * x, target_i
    the image latents noised to the next row's level (diffusers: (1 - mask) * proper + mask * latents)."""
    keep = start.keep
    inv = (np.float32(1.0) - keep).astype(np.float32)
    lv = start.cut.levels
    lat = start.image_latents

    def after(i: int, x: np.ndarray) -> np.ndarray:
        s, n = lv[i + 1]
        target = np.float32(s) * lat + np.float32(n) * noise0
        return (keep * target + inv * x).astype(np.float32)

    return after
