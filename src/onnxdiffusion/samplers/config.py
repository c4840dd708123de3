"""A folder's ``scheduler_config.json`` -> schedule, default sampler and sampler table.

This is the one function a runtime calls (`table_from_config`): the host loop and the compiled
Loop/unrolled graphs both consume the table it returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..schedules import FlowSchedule, NoiseSchedule
from .tables import SamplerTable, build_table

FLOW_CLASSES = ("FlowMatchEulerDiscreteScheduler",)
# diffusers scheduler class -> the sampler that reproduces it (the folder's default)
DEFAULT_SAMPLER = {
    "DDIMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_a",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
    "FlowMatchEulerDiscreteScheduler": "flow_euler",
}


def _get(d: dict[str, Any], key: str, default):
    # explicit nulls take the default too (e.g. "shift_terminal": null)
    return default if d.get(key) is None else d[key]


def flow_schedule_from_config(d: dict[str, Any]) -> FlowSchedule:
    return FlowSchedule(
        num_train_timesteps=int(_get(d, "num_train_timesteps", 1000)),
        shift=float(_get(d, "shift", 1.0)),
        use_dynamic_shifting=bool(_get(d, "use_dynamic_shifting", False)),
        base_shift=float(_get(d, "base_shift", 0.5)),
        max_shift=float(_get(d, "max_shift", 1.15)),
        base_image_seq_len=int(_get(d, "base_image_seq_len", 256)),
        max_image_seq_len=int(_get(d, "max_image_seq_len", 4096)),
        shift_terminal=None if not d.get("shift_terminal") else float(d["shift_terminal"]),
        time_shift_type=str(_get(d, "time_shift_type", "exponential")),
    )


def schedule_from_config(config: dict[str, Any]) -> NoiseSchedule | FlowSchedule:
    """The schedule a diffusers scheduler config describes (flow-matching classes give a FlowSchedule)."""
    if not isinstance(config, dict):
        raise ValueError(f"a scheduler config must be a JSON object, got {type(config).__name__}")
    if config.get("_class_name") in FLOW_CLASSES:
        return flow_schedule_from_config(config)
    return NoiseSchedule.from_scheduler_config(config)


def default_sampler(config: dict[str, Any]) -> str:
    """The sampler that reproduces the config's scheduler class (DDIM for classes we have no twin of)."""
    return DEFAULT_SAMPLER.get(config.get("_class_name"), "ddim")


def calculate_shift(config: dict[str, Any], image_seq_len: int) -> float:
    """mu for dynamic shifting from the image token count, as the SD3/Flux/Qwen-Image pipelines compute it."""
    return flow_schedule_from_config(config).mu_for(image_seq_len)


def table_from_config(config: dict[str, Any], steps: int, sampler: str | None = None, *,
                      spacing: str | None = None, mu: float | None = None, image_seq_len: int | None = None,
                      sigmas: np.ndarray | None = None) -> SamplerTable:
    """The sampler table for `steps` steps of `sampler` (default: the config's own) on the config's schedule.

    Flow schedules with ``use_dynamic_shifting`` need `mu`, or `image_seq_len` to compute it the way
    the pipelines do; `sigmas` are caller-given base sigmas (Flux and Qwen-Image pass
    ``linspace(1, 1/steps, steps)``).
    """
    schedule = schedule_from_config(config)
    if mu is None and image_seq_len is not None and isinstance(schedule, FlowSchedule) \
            and schedule.use_dynamic_shifting:
        mu = schedule.mu_for(image_seq_len)
    return build_table(sampler or default_sampler(config), schedule, steps, spacing, mu=mu, sigmas=sigmas)
