"""`evaluate`: generate the held-out prompts with fixed seeds, read them with the judge, score them."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from . import scenes as S
from ..errors import UserError
from ..families.tiny_vae import DECODERS
from .judge import Judge, score_scenes, summarize
from .metrics import frechet_distance, gaussian_stats
from .options import EvaluateOptions


def check_evaluate_options(options: EvaluateOptions, provider: str = "cpu") -> None:
    """Ranges checked before the judge or a model is loaded."""
    from ..runtime.guards import MAX_BATCH, MAX_GUIDANCE, is_int
    from ..runtime.session import resolve_provider
    from ..samplers import SAMPLERS

    for name, lo, hi in (("count", 1, 4096), ("batch", 1, MAX_BATCH), ("steps", 1, 1000), ("seed_offset", 0, 2**62)):
        v = getattr(options, name)
        if not is_int(v) or not lo <= v <= hi:
            raise UserError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    g = options.guidance
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= MAX_GUIDANCE:  # NaN fails both
        raise UserError(f"guidance must be a number in [0, {MAX_GUIDANCE:g}], got {g!r}")
    if options.sampler is not None and options.sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {options.sampler!r}; choose from {', '.join(SAMPLERS)}")
    if options.decoder not in DECODERS:
        raise UserError(f"decoder must be one of {', '.join(DECODERS)}, got {options.decoder!r}")
    resolve_provider(provider)


def heldout_scenes(options: EvaluateOptions) -> list[S.Scene]:
    if options.count < 1:
        raise UserError(f"count must be >= 1, got {options.count}")
    return S.scenes(options.split, options.count, start=options.seed_offset)


def item_latents(shape: tuple[int, ...], seeds: list[int]) -> np.ndarray:
    """Initial latents drawn per prompt-seed pair, so results do not depend on the batch size."""
    return np.stack([np.random.default_rng(s).standard_normal(shape, dtype=np.float32) for s in seeds])


def generate_set(pipe, scenes: list[S.Scene], options: EvaluateOptions, progress: bool = True,
                 step_callback=None) -> np.ndarray:
    """Images (N, H, W, 3) uint8 for the scenes' captions; scene i uses seed seed_offset + i."""
    from tqdm import tqdm

    images = []
    bar = tqdm(total=len(scenes), desc="generate", unit="img", disable=not progress)
    for start in range(0, len(scenes), options.batch):
        chunk = scenes[start : start + options.batch]
        seeds = [options.seed_offset + start + i for i in range(len(chunk))]
        shape = pipe.latent_shape_for(len(chunk))[1:]
        events = pipe.iter_generate(
            [sc.caption for sc in chunk], steps=options.steps, sampler=options.sampler, guidance=options.guidance,
            batch=len(chunk), latents=item_latents(shape, seeds), seed=seeds[0], decoder=options.decoder,
        )
        for event in events:
            if step_callback is not None:
                step_callback(start, event)
        images.append(event.images)
        bar.update(len(chunk))
    bar.close()
    return np.concatenate(images)


def evaluate_images(images: np.ndarray, scenes: list[S.Scene], judge: Judge) -> dict:
    pred = judge.predict(images)
    summary = summarize(score_scenes(scenes, pred))
    real = judge.embed(np.stack([S.render(sc) for sc in scenes]))
    summary["frechet_distance"] = frechet_distance(*gaussian_stats(pred["embedding"]), *gaussian_stats(real))
    return summary


def evaluate_model(model: Path | str | None = None, options: EvaluateOptions | None = None,
                   provider: str = "cpu", judge_path: Path | None = None, progress: bool = True) -> dict:
    """Attribute accuracy, strict prompt accuracy and Fréchet distance on the held-out prompts."""
    from ..runtime import Pipeline

    options = options or EvaluateOptions()
    check_evaluate_options(options, provider)
    scenes = heldout_scenes(options)
    try:
        judge = Judge.from_file(judge_path)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    pipe = Pipeline.from_folder(model, provider=provider)
    t0 = time.perf_counter()
    images = generate_set(pipe, scenes, options, progress)
    seconds = time.perf_counter() - t0
    result = evaluate_images(images, scenes, judge)
    result.update(
        model=str(pipe.folder),
        options=asdict(options),
        generate_seconds=round(seconds, 2),
        real_images_check=summarize(score_scenes(scenes, judge.predict(np.stack([S.render(sc) for sc in scenes])))),
    )
    result["_images"] = images
    return result
