"""Seeded inputs for a micro-batch, and rendering one compatible group (no per-step events).

Each request's initial latents (and ancestral noise) come from its own seed, drawn in the order
`Pipeline.prepare` draws them for `generate --seed S --batch n`; concatenated along the batch axis,
a batched request renders the same image as the request alone.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Renderable(Protocol):
    prompt: str
    negative_prompt: str
    n: int
    width: int
    height: int
    steps: int
    sampler: str
    guidance: float
    seed: int


def seeded_inputs(pipe, requests: list[Renderable]) -> dict:
    """Keyword arguments for `Pipeline.iter_generate` running `requests` (one compatible group) as one batch."""
    from ..runtime.pipeline import GenerateOptions

    r0 = requests[0]
    edit = getattr(r0, "edit", None)
    if edit is not None:  # an edit renders alone, its noise drawn from its seed as `generate --seed S --image` draws it
        if len(requests) != 1:
            raise ValueError("an image edit renders alone, not in a batch with other requests")
        negatives = [r0.negative_prompt] * r0.n if r0.negative_prompt else None
        return dict(prompt=[r0.prompt] * r0.n, negative_prompt=negatives, seed=r0.seed, steps=r0.steps, sampler=r0.sampler, guidance=r0.guidance, width=r0.width,
                    height=r0.height, batch=r0.n, **edit.feeds(), **_adapter(r0))
    needs_noise = pipe.table(GenerateOptions(steps=r0.steps, sampler=r0.sampler)).needs_noise
    latents, noise, prompts, negatives = [], [], [], []
    for r in requests:
        rng = np.random.default_rng(r.seed)
        shape = pipe.latent_shape_for(r.n, r.height, r.width)
        latents.append(rng.standard_normal(shape, dtype=np.float32))
        if needs_noise:
            noise.append(rng.standard_normal((r.steps, *shape), dtype=np.float32))
        prompts += [r.prompt] * r.n
        negatives += [r.negative_prompt] * r.n
    return dict(
        # no negative prompt at all is passed as None, as `generate` does (some families encode it as zeros)
        prompt=prompts, negative_prompt=negatives if any(negatives) else None, latents=np.concatenate(latents),
        noise=np.concatenate(noise, axis=1) if needs_noise else None, steps=r0.steps, sampler=r0.sampler,
        guidance=r0.guidance, width=r0.width, height=r0.height, batch=len(prompts), **_adapter(r0),
    )


def _adapter(r: Renderable) -> dict:
    """`loras=` of a request with adapters (serve's LoraSet: feeds converted once, shared by its batch); else nothing,
    so a request without one calls the pipeline exactly as before."""
    lora = getattr(r, "lora", None)
    return {} if lora is None else {"loras": lora.feeds}


def group_key(r: Renderable) -> tuple:
    edit = getattr(r, "edit", None)  # an edit renders alone
    lora = getattr(r, "lora", None)  # same adapter set or none: see JobRequest.batch_key
    return (r.width, r.height, r.steps, r.sampler, float(r.guidance), None if edit is None else id(edit),
            None if lora is None else lora.key)


def render_group(pipe, requests: list[Renderable]) -> list[np.ndarray]:
    """One backbone batch for compatible requests; returns each request's (n, H, W, 3) images."""
    result = pipe(**seeded_inputs(pipe, requests))
    offsets = np.cumsum([0] + [r.n for r in requests])
    return [result.images[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def render_mixed(pipe, requests: list[Renderable], max_images: int) -> list[np.ndarray]:
    """Any requests: grouped by compatibility into batches of at most `max_images`, answers in input order."""
    out: list[np.ndarray | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(group_key(r), []).append(i)
    for idx in groups.values():
        chunk: list[int] = []
        for i in idx + [None]:
            if i is None or (chunk and sum(requests[j].n for j in chunk) + requests[i].n > max_images):
                if chunk:
                    for j, images in zip(chunk, render_group(pipe, [requests[j] for j in chunk])):
                        out[j] = images
                chunk = []
            if i is not None:
                chunk.append(i)
    return out  # type: ignore[return-value]


def batch_invariant(pipe, width: int | None = None, height: int | None = None) -> bool:
    """Does a request render the same alone as next to another one? (2 steps; False for int8-dynamic.)"""
    from types import SimpleNamespace

    from ..runtime.pipeline import GenerateOptions

    w, h = width or pipe.info.default_width, height or pipe.info.default_height
    sampler = pipe.resolve(GenerateOptions()).sampler  # the folder's own (ddim does not apply to flow models)
    reqs = [SimpleNamespace(prompt=p, negative_prompt="", n=1, width=w, height=h, steps=2, sampler=sampler,
                            guidance=7.5, seed=i) for i, p in enumerate(("a small red circle", "a blue star above a square"))]
    return bool(np.array_equal(render_group(pipe, reqs[:1])[0], render_group(pipe, reqs)[0]))
