"""Quantization recipes: typed, versioned dataclasses that validate themselves on construction.

    QuantizeConfig(recipe=Int8StaticRecipe(calibrator="entropy"), calibration=CalibrationConfig(count=32))

Every recipe serializes with ``to_dict`` (``{"name", "version", **fields}``) and comes back with
``recipe_from_dict``; the manifest of a quantized folder stores exactly that dict. Command-line
``-O key=value`` strings are parsed by ``Recipe.with_options`` against the field types, so an
unknown key or an unparsable value is one ``UserError`` before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from .configs_base import (  # noqa: F401 - re-exported: configs is where every recipe name is found
    BACKBONE, FP16_COMPONENTS, INT8_PROVIDERS, KNOWN_PROVIDERS, MIN_CALIBRATION_PROMPTS, MODELOPT_KEEP_FLOAT, SAMPLER_NAMES,
    RECIPES, CalibrationConfig, Recipe, _build, _check, _choice, _parse,
)
from .configs_float import (  # noqa: F401 - each registers itself
    Fp8Recipe, Fp16Recipe, Int4WeightsRecipe, Nvfp4Recipe, W4A8Recipe, WeightsOnlyRecipe)
from .configs_int8 import Int8DynamicRecipe, Int8NaiveRecipe, Int8StaticRecipe, Int8TimestepRecipe, MixedRecipe  # noqa: F401
from .schedule import ScheduleConfig
from .speed_plan import SETTINGS as SPEED_SETTINGS

CONFIG_VERSION = 1
# RECIPES: every recipe registered itself (configs_base.register) when its module was imported above


def recipe_class(name: str) -> type[Recipe]:
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_from_dict(d: dict) -> Recipe:
    d = dict(d)
    cls = recipe_class(d.pop("name", None))
    version = d.pop("version", None)
    if version != cls.version and version not in cls.legacy:
        raise UserError(f"recipe {cls.name} version {version!r} is not supported (this build reads version {cls.version})")
    if version != cls.version:
        d = {**cls.legacy[version], **d}
    for key, only in cls.retired.items():  # fields an older dict of this recipe may carry, at one value
        if key in d:
            value = d.pop(key)
            if (tuple(value) if isinstance(value, list) else value) != only:
                raise UserError(f"recipe {cls.name}: field {key} was retired; a stored dict may only hold {only!r}, not {value!r}")
    return _build(cls, d, f"recipe {cls.name}")


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything that decides the bytes of the output folder (plus how its speed is measured)."""

    recipe: Recipe
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    correct: bool = False
    correct_method: str = "trajectory"  # trajectory (match fp32 latents step by step) | output (per-step outputs)
    provider: str = "cpu"
    threads: int = 1
    latency_runs: int = 30
    measure_memory: bool = True
    schedule: ScheduleConfig | None = None  # per-step precision schedule (quantize/schedule.py)
    # auto | on | off: sessions of the backbone opened to time it (quantize/speed_plan.py); in the dict only when
    # not auto, so that every folder made before it keeps its manifest's bytes
    latency: str = "auto"

    def __post_init__(self) -> None:
        _check(isinstance(self.recipe, Recipe), f"recipe must be a Recipe, got {type(self.recipe).__name__}")
        _choice("provider", self.provider, KNOWN_PROVIDERS)
        if self.provider not in self.recipe.providers:
            why = " (ONNX Runtime has no int8 convolution kernels there)" if self.recipe.providers == INT8_PROVIDERS else ""
            raise UserError(f"recipe {self.recipe.name} cannot run on provider {self.provider}{why}; "
                            f"supported: {', '.join(self.recipe.providers)}")
        if self.correct and not self.recipe.quantizes_backbone:
            raise UserError(f"--correct fits the quantized backbone's error; recipe {self.recipe.name} leaves the backbone float")
        _choice("correct_method", self.correct_method, ("trajectory", "output"))
        if self.schedule is not None:
            _check(isinstance(self.schedule, ScheduleConfig), "schedule must be a ScheduleConfig")
            _check(not self.correct, "--precision-schedule and --correct are alternative remedies; pick one")
            _check(self.recipe.quantizes and self.recipe.quantizes_backbone,
                   f"--precision-schedule switches between a quantized and a float backbone; recipe {self.recipe.name} "
                   f"leaves no quantized backbone")
        _check(isinstance(self.threads, int) and self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        _check(isinstance(self.latency_runs, int) and self.latency_runs >= 1, f"latency_runs must be >= 1, got {self.latency_runs}")
        _choice("latency", self.latency, SPEED_SETTINGS)

    def to_dict(self) -> dict:
        return {
            "version": CONFIG_VERSION,
            "recipe": self.recipe.to_dict(),
            "calibration": self.calibration.to_dict(),
            "correct": self.correct,
            "correct_method": self.correct_method,
            "provider": self.provider,
            "threads": self.threads,
            "latency_runs": self.latency_runs,
            "measure_memory": self.measure_memory,
            **({"schedule": self.schedule.to_dict()} if self.schedule is not None else {}),
            **({"latency": self.latency} if self.latency != "auto" else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> QuantizeConfig:
        d = dict(d)
        version = d.pop("version", None)
        if version != CONFIG_VERSION:
            raise UserError(f"quantize config version {version!r} is not supported (this build reads {CONFIG_VERSION})")
        recipe = recipe_from_dict(d.pop("recipe"))
        calibration = CalibrationConfig.from_dict(d.pop("calibration", {}))
        if d.get("schedule") is not None:
            d["schedule"] = ScheduleConfig.from_dict(d["schedule"])
        return _build(cls, {**d, "recipe": recipe, "calibration": calibration}, "quantize config")
