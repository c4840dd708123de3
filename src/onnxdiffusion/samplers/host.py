"""Reference numpy implementation of the sampler-table loop (see ``tables`` for the contract)."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .tables import SamplerTable

ModelFn = Callable[[np.ndarray, float], np.ndarray]


def _check_noise(noise, table: SamplerTable, shape: tuple[int, ...]) -> np.ndarray | None:
    want = (table.num_steps, *shape)
    if noise is None:
        if table.needs_noise or np.any(table.column("e") != 0):
            raise ValueError(f"sampler {table.sampler!r} needs noise of shape {want}, got None")
        return None
    noise = np.asarray(noise, dtype=np.float32)
    if noise.shape != want:
        raise ValueError(f"noise must have shape {want} (num_steps, *latents.shape), got {noise.shape}")
    return noise


def iter_sample(model_fn: ModelFn, init_latents: np.ndarray, table: SamplerTable,
                noise: np.ndarray | None = None, after_step: Callable[[int, np.ndarray], np.ndarray] | None = None
                ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Run the loop, yielding ``(i, x, D)`` after each step (x: new state, D: that step's x0 estimate).

    `after_step(i, x)` -> x, when given, rewrites the state after row i (inpainting's blend with the
    noised image latents). Arguments are validated here, eagerly, not on the first ``next()``.
    """
    x = np.asarray(init_latents, dtype=np.float32)
    noise = _check_noise(noise, table, x.shape)
    return _loop(model_fn, x, table, noise, after_step=after_step)


def iter_sample_from(model_fn: ModelFn, x: np.ndarray, d_prev: np.ndarray, table: SamplerTable, start: int,
                     noise: np.ndarray | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """The loop resumed at step `start` from the state before it: x (already scaled; the x that
    step start-1 yielded) and d_prev (the D it yielded; zeros at start 0). Yields as iter_sample."""
    x = np.asarray(x, dtype=np.float32)
    noise = _check_noise(noise, table, x.shape)
    if not 0 <= start < table.num_steps:
        raise ValueError(f"start must be in [0, {table.num_steps}), got {start}")
    if table.host_only and start > 0:
        raise ValueError(f"{table.sampler} keeps more history than one D: it cannot resume mid-trajectory")
    return _loop(model_fn, x, table, noise, start, np.asarray(d_prev, dtype=np.float32))


def _loop(model_fn: ModelFn, x: np.ndarray, table: SamplerTable, noise: np.ndarray | None, start: int = 0,
          d_prev: np.ndarray | None = None, after_step=None):
    # float32 arithmetic on float32 coefficients, exactly what an ONNX graph will do.
    if d_prev is None:
        x = x * np.float32(table.init_scale)
        d_prev = np.zeros_like(x)
    depth = table.rows.shape[1] - 10  # history columns d2, d3, ... (multistep methods; 0 for most)
    older: list[np.ndarray] = [np.zeros_like(x)] * depth  # H_2, H_3, ...
    of_output = table.history == "output"
    for i, row in enumerate(table.rows[start:], start):
        t, c_in, p, q, a, c, d, e, r, k = row[:10]
        out = np.asarray(model_fn(x * c_in, float(t)), dtype=np.float32)
        if out.shape != x.shape:
            raise ValueError(f"model output shape {out.shape} does not match latents shape {x.shape} at step {i}")
        den = p * x + q * out
        x = a * x + c * den
        # Adding an exact 0*term would not change x; skipping it just saves full-tensor ops.
        if d != 0:
            x = x + d * d_prev
        if e != 0:
            x = x + e * noise[i]
        if k != 0:  # DDIM clip_sample: the x0 term alone is clipped
            x = x + k * np.clip(den, -r, r)
        for coef, h in zip(row[10:], older):
            if coef != 0:
                x = x + coef * h
        if after_step is not None:
            x = after_step(i, x)
        if depth:
            older = [d_prev, *older[:-1]]
        d_prev = out if of_output else den
        yield i, x, den


def sample(model_fn: ModelFn, init_latents: np.ndarray, table: SamplerTable,
           noise: np.ndarray | None = None,
           callback: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> np.ndarray:
    """Return the final latents; ``callback(i, x, D)`` is called after each step."""
    x = None
    for i, x, den in iter_sample(model_fn, init_latents, table, noise):
        if callback is not None:
            callback(i, x, den)
    return x
