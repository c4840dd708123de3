"""What a generation takes and gives: the options (unset ones resolved from the model's recommended
settings), the per-step event and the result."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..folder.manifest import Recommended


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


@dataclass(frozen=True)
class GenerateOptions:
    """None for steps/sampler/guidance: the model's recommended value (manifest `recommended`), else the
    defaults above (sampler: the one the folder's scheduler_config.json names). Ranges are in runtime/guards.py."""
    steps: int | None = None
    sampler: str | None = None
    guidance: float | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    batch: int = 1
    spacing: str | None = None
    loop: str = "host"  # host | loop | unrolled
    strength: float | None = None  # img2img / inpainting: share of the schedule that runs, (0, 1]; None: 1
    mask_blur: float = 0.0  # inpainting: Gaussian blur radius (pixels) of the mask before it is binarized
    # inpainting from a picture: paste its pixels back outside the mask (diffusers' apply_overlay), so the
    # VAE's round trip does not touch them; off: the decoded image as is (diffusers' default)
    mask_overlay: bool = False
    # step caching (techniques/caching.py): a SPEC like "first_block:0.2", a dict {"method": ..., setting: value}
    # or a method's spec object; host loop or a Loop graph compiled with compile-loop --cache
    cache: str | dict | None = None
    # adaptive stopping (techniques/stop.py): "THRESHOLD[:MIN_STEPS]" or a number; host loop or a Loop graph
    # compiled with compile-loop --stop-early; the result's settings["steps_run"] says how many steps ran
    stop_early: str | float | None = None
    # full (the VAE) | tiny (the folder's vae_decoder_tiny: runtime/tiny_decoder.py); None: the folder's
    # recommended (a tuned folder's), else full
    decoder: str | None = None


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
