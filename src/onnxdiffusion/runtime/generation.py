"""What a generation takes and gives: the options (unset ones resolved from the model's recommended
settings), the per-step event and the result."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..folder.manifest import Recommended
from .options import GenerateOptions  # noqa: F401  (re-exported: its name lives here too)


@dataclass
class StepEvent:
    step: int
    num_steps: int
    timestep: float
    latents: np.ndarray
    denoised: np.ndarray
    stopped: bool = False  # adaptive stopping ended the run after this step (the result is `denoised`)


@dataclass
class GenerationResult:
    images: np.ndarray  # (batch, H, W, 3) uint8
    latents: np.ndarray  # final latents before VAE scaling
    init_latents: np.ndarray
    noise: np.ndarray | None
    settings: dict = field(default_factory=dict)

    def save(self, path: Path | str, overwrite: bool = False) -> list[Path]:
        from ..folder.imageio import save_images

        return save_images(self.images, Path(path), overwrite)


DEFAULT_STEPS, DEFAULT_GUIDANCE = 20, 7.5


def resolve_options(options: GenerateOptions, recommended: Recommended | dict | None) -> GenerateOptions:
    """Fill unset steps / sampler / guidance / decoder (and the step cache) from the model's recommended settings
    (manifest), else defaults."""
    r = recommended if isinstance(recommended, Recommended) else Recommended.from_dict(recommended or {})
    if options.decoder is None:
        options = replace(options, decoder=r.decoder or "full")
    if options.cache is None and r.cache is not None and options.stop_early is None and options.loop in (None, "host"):
        # a tuned folder's cache; an adaptive stop asked for replaces it (the two do not combine), and a
        # compiled loop runs only what it was compiled with; `cache="none"` turns it off
        options = replace(options, cache=r.cache)
    if None not in (options.steps, options.sampler, options.guidance):
        return options
    return replace(
        options,
        steps=options.steps if options.steps is not None else (r.steps if r.steps is not None else DEFAULT_STEPS),
        sampler=options.sampler if options.sampler is not None else r.sampler,  # None: the folder's
        guidance=options.guidance if options.guidance is not None else (
            r.guidance if r.guidance is not None else DEFAULT_GUIDANCE),
    )
