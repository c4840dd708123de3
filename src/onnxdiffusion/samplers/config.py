"""A folder's ``scheduler_config.json`` -> the sampler table a runtime runs (`table_from_config`).

The folder's class names the default sampler.  Any sampler X runs as diffusers'
``ClassOf(X).from_config(folder_config)`` would: X's class reads its own options from the config
(absent ones take that class's defaults, other classes' keys are ignored).  Every option of that
class is either reproduced or refused with a one-line error naming it; the defaults below are
diffusers 0.39's and a test checks them against its signatures.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from .schedules import FlowSchedule, NoiseSchedule
from .options import SamplerOptions
from .tables import SamplerTable, build_table

_BETAS = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
          "trained_betas": None, "prediction_type": "epsilon", "steps_offset": 0, "rescale_betas_zero_snr": False}
_SHAPES = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}
_THRESHOLD = {"thresholding": False, "dynamic_thresholding_ratio": 0.995, "sample_max_value": 1.0}
_FLOW = {"num_train_timesteps": 1000, "shift": 1.0}

CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "DDIMScheduler": {**_BETAS, **_THRESHOLD, "clip_sample": True, "set_alpha_to_one": True, "clip_sample_range": 1.0,
                      "timestep_spacing": "leading"},
    "EulerDiscreteScheduler": {**_BETAS, **_SHAPES, "interpolation_type": "linear", "sigma_min": None,
                               "sigma_max": None, "timestep_spacing": "linspace", "timestep_type": "discrete",
                               "final_sigmas_type": "zero"},
    "EulerAncestralDiscreteScheduler": {**_BETAS, "timestep_spacing": "linspace"},
    "DPMSolverMultistepScheduler": {**_BETAS, **_THRESHOLD, **_SHAPES, "solver_order": 2,
                                    "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
                                    "lower_order_final": True, "euler_at_final": False, "use_lu_lambdas": False,
                                    "use_flow_sigmas": False, "flow_shift": 1.0, "final_sigmas_type": "zero",
                                    "lambda_min_clipped": -math.inf, "variance_type": None,
                                    "timestep_spacing": "linspace", "use_dynamic_shifting": False,
                                    "time_shift_type": "exponential"},
    "FlowMatchEulerDiscreteScheduler": {**_FLOW, **_SHAPES, "use_dynamic_shifting": False, "base_shift": 0.5,
                                        "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
                                        "invert_sigmas": False, "shift_terminal": None,
                                        "time_shift_type": "exponential", "stochastic_sampling": False},
    "FlowMatchHeunDiscreteScheduler": dict(_FLOW),
    "PNDMScheduler": {k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"} | {
        "skip_prk_steps": False, "set_alpha_to_one": False, "timestep_spacing": "leading"},
    "UniPCMultistepScheduler": {**_BETAS, **_THRESHOLD, **_SHAPES, "solver_order": 2, "predict_x0": True,
                                "solver_type": "bh2", "lower_order_final": True, "disable_corrector": [],
                                "solver_p": None, "use_flow_sigmas": False, "flow_shift": 1.0,
                                "timestep_spacing": "linspace", "final_sigmas_type": "zero",
                                "use_dynamic_shifting": False, "time_shift_type": "exponential",
                                "sigma_min": None, "sigma_max": None, "shift_terminal": None},
    **{cls: {**_BETAS, **_THRESHOLD, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
             "original_inference_steps": 50, "clip_sample": False, "clip_sample_range": 1.0,
             "set_alpha_to_one": True, "timestep_spacing": "leading", "timestep_scaling": 10.0}
       for cls in ("LCMScheduler", "TCDScheduler")},
}
# sampler -> the diffusers class it reproduces; and a folder's class -> its default sampler
SAMPLER_CLASS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler",
                 "euler_a": "EulerAncestralDiscreteScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler",
                 "flow_euler": "FlowMatchEulerDiscreteScheduler", "flow_heun": "FlowMatchHeunDiscreteScheduler",
                 "pndm": "PNDMScheduler", "unipc": "UniPCMultistepScheduler", "lcm": "LCMScheduler",
                 "tcd": "TCDScheduler"}
DEFAULT_SAMPLER = {cls: sampler for sampler, cls in SAMPLER_CLASS.items()}
FLOW_CLASSES = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")


class _Config:
    """One class's view of a config dict: its keys with that class's defaults (explicit nulls too)."""

    def __init__(self, config: dict[str, Any], cls: str, overrides: dict[str, Any] | None = None):
        self.cls = cls
        defaults = CLASS_DEFAULTS[cls]
        merged = {**config, **(overrides or {})}
        self.values = {k: (d if merged.get(k) is None else merged[k]) for k, d in defaults.items()}

    def __getitem__(self, key: str):
        return self.values[key]

    def refuse(self, key: str, why: str = "not reproduced") -> ValueError:
        return ValueError(f"scheduler option {key}={self.values[key]!r} ({self.cls}) is {why}")

    def require(self, key: str, allowed: tuple) -> Any:
        if self.values[key] not in allowed:
            raise self.refuse(key, f"not reproduced; supported: {', '.join(map(repr, allowed))}")
        return self.values[key]

    def off(self, *keys: str) -> None:
        for key in keys:
            if self.values[key]:
                raise self.refuse(key)

    def sigma_shape(self) -> str:
        on = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas")
              if self.values.get(k)]
        if len(on) > 1:
            raise self.refuse(on[1], f"not allowed together with {on[0]}")
        names = {"use_karras_sigmas": "karras", "use_exponential_sigmas": "exponential",
                 "use_beta_sigmas": "beta", "use_lu_lambdas": "lu"}
        return names[on[0]] if on else "default"


def _noise_schedule(c: _Config, prediction_types: tuple[str, ...]) -> NoiseSchedule:
    c.off("thresholding") if "thresholding" in c.values else None
    c.require("prediction_type", prediction_types)
    trained = c["trained_betas"]
    return NoiseSchedule(
        num_train_timesteps=int(c["num_train_timesteps"]), beta_start=float(c["beta_start"]),
        beta_end=float(c["beta_end"]), beta_schedule=str(c["beta_schedule"]),
        prediction_type=str(c["prediction_type"]), steps_offset=int(c["steps_offset"]),
        timestep_spacing=str(c["timestep_spacing"]), set_alpha_to_one=bool(c.values.get("set_alpha_to_one", True)),
        rescale_betas_zero_snr=bool(c.values.get("rescale_betas_zero_snr", False)),
        trained_betas=None if trained is None else tuple(float(b) for b in trained),
    )


def _flow_schedule(c: _Config, shift_key: str = "shift") -> FlowSchedule:
    v = c.values
    return FlowSchedule(
        num_train_timesteps=int(v["num_train_timesteps"]), shift=float(v[shift_key]),
        use_dynamic_shifting=bool(v.get("use_dynamic_shifting", False)),
        base_shift=float(v.get("base_shift", 0.5)), max_shift=float(v.get("max_shift", 1.15)),
        base_image_seq_len=int(v.get("base_image_seq_len", 256)), max_image_seq_len=int(v.get("max_image_seq_len", 4096)),
        shift_terminal=float(v["shift_terminal"]) if v.get("shift_terminal") else None,
        time_shift_type=str(v.get("time_shift_type", "exponential")),
    )


def _ddim(c: _Config):
    clip = float(c["clip_sample_range"]) if c["clip_sample"] else None
    return _noise_schedule(c, ("epsilon", "v_prediction", "sample")), SamplerOptions(clip_sample_range=clip)


def _euler(c: _Config):
    c.require("interpolation_type", ("linear", "log_linear"))
    c.require("timestep_type", ("discrete", "continuous"))
    c.require("final_sigmas_type", ("zero", "sigma_min"))
    opts = SamplerOptions(sigma_shape=c.sigma_shape(), sigma_min=c["sigma_min"], sigma_max=c["sigma_max"],
                          final_sigmas_type=c["final_sigmas_type"], interpolation_type=c["interpolation_type"],
                          timestep_type=c["timestep_type"])
    return _noise_schedule(c, ("epsilon", "v_prediction", "sample")), opts


def _euler_a(c: _Config):
    return _noise_schedule(c, ("epsilon", "v_prediction")), SamplerOptions()  # diffusers has no "sample" here


def _dpm(c: _Config):
    c.off("thresholding")
    if c["variance_type"] is not None:
        raise c.refuse("variance_type")
    c.require("solver_order", (1, 2))
    algorithm = c.require("algorithm_type", ("dpmsolver++", "sde-dpmsolver++"))
    c.require("solver_type", ("midpoint", "heun"))
    c.require("final_sigmas_type", ("zero", "sigma_min"))
    c.require("time_shift_type", ("exponential",))
    opts = dict(solver_order=int(c["solver_order"]), solver_type=c["solver_type"],
                lower_order_final=bool(c["lower_order_final"]), euler_at_final=bool(c["euler_at_final"]),
                sde=algorithm == "sde-dpmsolver++", final_sigmas_type=c["final_sigmas_type"])
    if c["use_flow_sigmas"]:
        if c.sigma_shape() != "default":
            raise c.refuse("use_flow_sigmas", f"not reproduced with {c.sigma_shape()} sigmas")
        c.require("prediction_type", ("flow_prediction",))
        if c["final_sigmas_type"] != "zero":
            raise c.refuse("final_sigmas_type", "not reproduced with use_flow_sigmas")
        return _flow_schedule(c, "flow_shift"), SamplerOptions(flow_grid="dpm", **opts)
    if c["use_dynamic_shifting"]:
        raise c.refuse("use_dynamic_shifting", "only reproduced with use_flow_sigmas")
    opts.update(sigma_shape=c.sigma_shape(), lambda_min_clipped=float(c["lambda_min_clipped"]))
    return _noise_schedule(c, ("epsilon", "v_prediction", "sample", "flow_prediction")), SamplerOptions(**opts)


def _flow_euler(c: _Config):
    c.off("invert_sigmas")
    c.require("time_shift_type", ("exponential", "linear"))
    opts = SamplerOptions(sigma_shape=c.sigma_shape(), stochastic=bool(c["stochastic_sampling"]))
    return _flow_schedule(c), opts


def _flow_heun(c: _Config):
    return _flow_schedule(c), SamplerOptions()


def _flow_heun_on_folder_grid(config: dict[str, Any]):
    """flow_heun on a folder whose scheduler is not FlowMatchHeun: Heun's update on the folder's own flow grid.

    diffusers' FlowMatchHeunDiscreteScheduler.set_timesteps takes neither sigmas nor mu, so it cannot run in the
    pipelines that pass them (Flux, Kontext, FLUX.2, Qwen-Image) and its static-shift grid is not what those
    pipelines step on (1000, 900, 750, 500 at 4 steps against Flux's dynamic 1000, 827, 615, 347). The sampler is
    how to integrate between noise levels, not which levels: the model was trained, and the folder's scheduler
    configured, for the levels the pipeline's own scheduler visits (its dynamic shift by mu, shift_terminal,
    sigma shape), so Heun steps on exactly those, as DPM-Solver++ does here (flow_grid "flowmatch")."""
    c = _Config(config, "FlowMatchEulerDiscreteScheduler")
    c.off("invert_sigmas")
    c.require("time_shift_type", ("exponential", "linear"))
    return _flow_schedule(c), SamplerOptions(sigma_shape=c.sigma_shape())


def _pndm(c: _Config):
    if not c["skip_prk_steps"]:
        raise c.refuse("skip_prk_steps", "not reproduced (the Runge-Kutta warm-up); Stable Diffusion folders "
                                         "ship skip_prk_steps=true")
    return _noise_schedule(c, ("epsilon", "v_prediction")), SamplerOptions(skip_prk_steps=True)


def _unipc(c: _Config):
    c.off("thresholding", "use_flow_sigmas", "use_dynamic_shifting")
    if c["solver_p"] is not None:
        raise c.refuse("solver_p")
    if not c["predict_x0"]:
        raise c.refuse("predict_x0", "not reproduced (only the x0-space UniPC, diffusers' default)")
    c.require("solver_order", (1, 2, 3))
    c.require("solver_type", ("bh1", "bh2"))
    c.require("final_sigmas_type", ("zero", "sigma_min"))
    for key in ("sigma_min", "sigma_max", "shift_terminal"):  # read only with flow sigmas / not at all
        if c[key] is not None:
            raise c.refuse(key)
    if c["solver_type"] == "bh1" and c["final_sigmas_type"] == "zero":
        raise c.refuse("solver_type", "not reproduced with final_sigmas_type='zero' (diffusers' own last step is "
                                      "NaN there: B(h) = h is infinite at sigma 0)")
    if not c["lower_order_final"] and c["final_sigmas_type"] == "zero" and c["solver_order"] > 1:
        raise c.refuse("lower_order_final", "not reproduced with final_sigmas_type='zero' (diffusers' own last "
                                            "step is inf there: a multistep difference over an infinite h)")
    shape = c.sigma_shape()
    if shape != "default" and c["final_sigmas_type"] != "zero":
        raise c.refuse("final_sigmas_type", f"not reproduced with {shape} sigmas (it repeats the last sigma)")
    disabled = c["disable_corrector"] or []
    opts = SamplerOptions(sigma_shape=shape, final_sigmas_type=c["final_sigmas_type"],
                          solver_order=int(c["solver_order"]), unipc_solver=c["solver_type"],
                          lower_order_final=bool(c["lower_order_final"]),
                          disable_corrector=tuple(int(i) for i in disabled))
    return _noise_schedule(c, ("epsilon", "v_prediction", "sample")), opts


def _consistency(c: _Config):
    clip = float(c["clip_sample_range"]) if c["clip_sample"] else None
    opts = SamplerOptions(clip_sample_range=clip, original_steps=int(c["original_inference_steps"]),
                          timestep_scaling=float(c["timestep_scaling"]))
    return _noise_schedule(c, ("epsilon", "v_prediction", "sample")), opts


def _tcd(c: _Config):
    # TCDScheduler.step reads neither clip_sample nor thresholding: both are inert there
    c.values.update(clip_sample=False, thresholding=False)
    return _consistency(c)


_RESOLVE = {"DDIMScheduler": _ddim, "EulerDiscreteScheduler": _euler, "EulerAncestralDiscreteScheduler": _euler_a,
            "DPMSolverMultistepScheduler": _dpm, "FlowMatchEulerDiscreteScheduler": _flow_euler,
            "FlowMatchHeunDiscreteScheduler": _flow_heun, "PNDMScheduler": _pndm, "UniPCMultistepScheduler": _unipc,
            "LCMScheduler": _consistency, "TCDScheduler": _tcd}


def is_flow_config(config: dict[str, Any]) -> bool:
    cls = config.get("_class_name")
    if isinstance(cls, str) and cls.startswith("FlowMatch") and cls not in DEFAULT_SAMPLER:
        return True  # FlowMatchLCM etc.: a flow schedule without its own sampler here
    return cls in FLOW_CLASSES or (
        config.get("_class_name") == "DPMSolverMultistepScheduler" and bool(config.get("use_flow_sigmas")))


# Classes whose schedule is not betas-derived nor rectified flow (sigma-space EDM, VE SDE, consistency
# models on Karras sigmas): no sampler here runs them, so a folder naming one is refused.
_FOREIGN_PREFIXES = ("EDM", "ScoreSde", "CMStochastic", "KarrasVe", "Amused", "VQDiffusion", "DDPMWuerstchen")
_WARNED: set[str] = set()


def default_sampler(config: dict[str, Any]) -> str:
    """The sampler reproducing the folder's scheduler class.

    A class without a twin here (LMS, Heun, KDPM2, DEIS, ...) runs on its own schedule with ddim
    (flow_euler for FlowMatch* classes), and says so once per class; classes on a schedule of
    another kind (EDM, VE) are refused.  Never silent: diffusers' image differs.
    """
    cls = config.get("_class_name")
    if cls in DEFAULT_SAMPLER:
        return DEFAULT_SAMPLER[cls]
    if isinstance(cls, str) and cls.startswith(_FOREIGN_PREFIXES):
        raise ValueError(f"scheduler {cls} has no sampler here (its sigmas are not a betas or flow schedule); "
                         f"re-save the folder with one of {', '.join(sorted(DEFAULT_SAMPLER))}")
    fallback = "flow_euler" if isinstance(cls, str) and cls.startswith("FlowMatch") else "ddim"
    if cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(f"scheduler {cls} has no sampler here: running {fallback} on its schedule, so images "
                      f"differ from diffusers' {cls} (pass a sampler to choose another)", UserWarning, stacklevel=2)
    return fallback


def resolve(config: dict[str, Any], sampler: str | None = None
            ) -> tuple[str, NoiseSchedule | FlowSchedule, SamplerOptions]:
    """(sampler, schedule, options) for running `sampler` (default: the folder's) on this config."""
    if not isinstance(config, dict):
        raise ValueError(f"a scheduler config must be a JSON object, got {type(config).__name__}")
    sampler = sampler or default_sampler(config)
    if sampler not in SAMPLER_CLASS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {tuple(SAMPLER_CLASS)}")
    cls = SAMPLER_CLASS[sampler]
    flow_folder = is_flow_config(config)
    overrides = None
    if flow_folder and cls == "DPMSolverMultistepScheduler" and not config.get("use_flow_sigmas"):
        # DPM-Solver++ on a flow-matching folder: the folder's own flow schedule, velocity prediction
        c = _Config(config, "FlowMatchEulerDiscreteScheduler")
        dpm = _Config(config, cls, {"prediction_type": "flow_prediction", "use_flow_sigmas": True})
        _, opts = _dpm(dpm)
        return sampler, _flow_schedule(c), SamplerOptions(**{**opts.__dict__, "flow_grid": "flowmatch"})
    if flow_folder and sampler == "flow_heun" and config.get("_class_name") not in (cls, "DPMSolverMultistepScheduler"):
        return sampler, *_flow_heun_on_folder_grid(config)
    if flow_folder and cls in FLOW_CLASSES and config.get("_class_name") == "DPMSolverMultistepScheduler":
        overrides = {"shift": config.get("flow_shift", 1.0)}
    c = _Config(config, cls, overrides)
    schedule, opts = _RESOLVE[cls](c)
    if isinstance(schedule, FlowSchedule) != flow_folder:
        kind = "flow-matching" if flow_folder else "betas-derived"
        raise ValueError(f"sampler {sampler!r} does not apply to this folder's {kind} schedule "
                         f"({config.get('_class_name')})")
    return sampler, schedule, opts


def schedule_from_config(config: dict[str, Any]) -> NoiseSchedule | FlowSchedule:
    """The schedule of the folder's default sampler."""
    return resolve(config)[1]


def calculate_shift(config: dict[str, Any], image_seq_len: int) -> float:
    """mu for dynamic shifting from the image token count, as the SD3/Flux/Qwen-Image pipelines compute it."""
    return _flow_schedule(_Config(config, "FlowMatchEulerDiscreteScheduler")).mu_for(image_seq_len)


def table_from_config(config: dict[str, Any], steps: int, sampler: str | None = None, *,
                      spacing: str | None = None, mu: float | None = None, image_seq_len: int | None = None,
                      sigmas: np.ndarray | None = None) -> SamplerTable:
    """The sampler table for `steps` steps of `sampler` (default: the folder's own) on the config's schedule.

    Flow schedules with ``use_dynamic_shifting`` need `mu`, or `image_seq_len` to compute it the way
    the pipelines do; `sigmas` are caller-given base sigmas (Flux and Qwen-Image pass
    ``linspace(1, 1/steps, steps)``).  `spacing` overrides a betas schedule's timestep spacing.
    """
    sampler, schedule, opts = resolve(config, sampler)
    if mu is None and image_seq_len is not None and isinstance(schedule, FlowSchedule) \
            and schedule.use_dynamic_shifting:
        mu = schedule.mu_for(image_seq_len)
    return build_table(sampler, schedule, steps, spacing, mu=mu, sigmas=sigmas, options=opts)
