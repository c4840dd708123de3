"""What every bench runner shares: the job, the generation record, the runner interface, timing helpers."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .rss import current_rss_bytes
from .variants import VariantSpec


@dataclass
class Generation:
    images: np.ndarray  # (batch, H, W, 3) uint8
    total_s: float
    text_encoder_s: float
    sampling_s: float  # all denoising steps (backbone calls + sampler updates)
    vae_s: float
    step_s: list[float] | None = None  # per step, when the loop is visible (host loops)
    step_latents: list[np.ndarray] | None = None  # x after each step (capture=True, host loops)
    final_latents: np.ndarray | None = None
    # CPU seconds of the process that ran the model (all its threads): with 1 thread it leaves out the time other
    # processes held the core, so on a loaded machine it is the steadier measure of the work itself
    cpu_s: float | None = None
    step_cpu_s: list[float] | None = None  # CPU seconds per step, where step_s is measured in this process
    # UNet/transformer calls of one generation (a CFG pair batched in one call counts once): rows compare only
    # where it is the same
    backbone_calls: int | None = None


@dataclass
class Job:
    prompts: list[str]
    latents: np.ndarray
    guidance: float
    height: int
    width: int
    capture: bool = False


class Runner:
    spec: VariantSpec
    load_info: dict

    def load(self) -> dict:
        raise NotImplementedError

    def generate(self, job: Job) -> Generation:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Timed:
    """Wraps a bound method, adding its wall time to `sink[key]`."""

    def __init__(self, fn, sink: dict, key: str):
        self.fn, self.sink, self.key = fn, sink, key

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            now = time.perf_counter()
            self.sink[self.key] += now - t
            self.sink[self.key + "_end"] = now


def _delta(before: int | None) -> int | None:
    now = current_rss_bytes()
    return None if before is None or now is None else now - before


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --- peers in their own venvs -------------------------------------------------------------------------
