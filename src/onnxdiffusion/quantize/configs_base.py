"""Recipe base: validation helpers, the `Recipe` dataclass (to_dict / with_options), calibration config.

The recipes themselves live by kind in configs_int8.py and configs_float.py; configs.py collects them.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import UserError
from ..families.recipe_names import backbone_key
from ..samplers.tables import SAMPLERS

# ONNX Runtime has no INT8 convolution kernels on CUDA and TensorRT wants its own calibration
# table, so the int8 recipes are CPU-only; MatMulNBits and fp16 also run on CUDA.
INT8_PROVIDERS = ("cpu",)
KNOWN_PROVIDERS = ("cpu", "cuda", "tensorrt", "openvino", "dml", "coreml")
# the name recipes give the backbone whatever the family (kept: manifests of existing folders record it);
# `-O components=` also takes "backbone" and the family's own name (families.backbone_key)
BACKBONE = backbone_key("backbone")
FP16_COMPONENTS = (BACKBONE, "text_encoder", "vae_decoder", "vae_encoder")
MIN_CALIBRATION_PROMPTS = 4
INT4_ALGORITHMS = ("default", "hqq", "gptq", "gptq-clip")  # int4-weights `algorithm` (quantize/_ort.py, quantize/gptq.py)
SAMPLER_NAMES = SAMPLERS  # calibration samples as `generate` does: every sampler the run time has
# The layers NVIDIA Model Optimizer's diffusers examples leave unquantized (its `filter_func`),
# as node-name patterns; the fp8 / nvfp4 recipes keep them float by default. Measured on the
# embedded UNet (16 held-out pairs): fp8 W8A8 41.7 dB with everything quantized, 43.7 dB without these.
MODELOPT_KEEP_FLOAT = ("*time_emb_proj*", "*time_embedding*", "*conv_in*", "*conv_out*", "*conv_shortcut*",
                       "*add_embedding*", "*pos_embed*", "*time_text_embed*", "*context_embedder*", "*norm_out*",
                       "*x_embedder*", "*patch_embed*")
# `-O rotate=hadamard[:GROUP]` (quantize/rotation.py): orders of the regular Hadamard matrices (powers of 4)
ROTATION_GROUPS = (16, 64, 256)
DEFAULT_ROTATION_GROUP = 64


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name} must be one of {', '.join(choices)}; got {value!r}")


# --- calibration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrationConfig:
    """Where calibration data comes from: fp32 sampling runs over a prompt split, seeded.

    Prompts are the first `count` captions of the scene world's "calib" split (disjoint from the
    held-out split evaluation uses), or the lines of `prompts_file`. Prompt i starts from the
    latents of seed `seed + i`; every step of every run is recorded, uncond and cond halves.
    The default seeds start at 10000 so that they are disjoint from evaluation's (0, 1, 2, ...):
    a correction fitted on trajectories that share their initial noise with the evaluated images
    looked far better than it is.
    """

    count: int = 32
    prompts_file: str | None = None
    seed: int = 10_000
    sampler: str = "ddim"
    steps: int = 20
    guidance: float = 4.0
    batch: int = 16

    def __post_init__(self) -> None:
        _check(isinstance(self.count, int) and self.count >= MIN_CALIBRATION_PROMPTS,
               f"too few calibration samples: need >= {MIN_CALIBRATION_PROMPTS} prompts, got {self.count}")
        _choice("calibration sampler", self.sampler, SAMPLER_NAMES)
        _check(isinstance(self.steps, int) and 2 <= self.steps <= 1000, f"calibration steps must be in [2, 1000], got {self.steps}")
        _check(math.isfinite(self.guidance) and self.guidance >= 0, f"calibration guidance must be >= 0, got {self.guidance}")
        _check(isinstance(self.batch, int) and self.batch >= 1, f"calibration batch must be >= 1, got {self.batch}")
        _check(isinstance(self.seed, int) and self.seed >= 0, f"calibration seed must be >= 0, got {self.seed}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CalibrationConfig:
        return _build(cls, d, "calibration")


# --- recipes -------------------------------------------------------------------------------

RECIPES: dict[str, type[Recipe]] = {}  # name -> class, in the order the recipes registered


def register(cls):
    """Class decorator: the recipe is known by its name (configs.recipe_class, the CLI's --recipe)."""
    RECIPES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Recipe:
    """A recipe's fields decide its output's bytes; its class attributes and properties declare what
    `quantize` must prepare for it (api.py's stages read them, nothing else is probed)."""

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    quantizes: ClassVar[bool] = True  # False: a float conversion (fp16), no quantized graph
    calibrated: ClassVar[bool] = False  # needs fp32 sampling trajectories as calibration data
    random_calibration: ClassVar[bool] = False  # calibrates on random latents instead (int8-naive)
    # builds from a > 2 GB backbone held as a skeleton (onnxio.files: weights read only by the
    # quantizer); the others get the backbone with its weights in memory
    takes_skeleton: ClassVar[bool] = False
    providers: ClassVar[tuple[str, ...]] = INT8_PROVIDERS
    # field values a dict of an older version implied for fields added since (version -> values)
    legacy: ClassVar[dict[int, dict]] = {}
    # fields older dicts of this recipe carried that it no longer has, with the only value they may hold
    retired: ClassVar[dict[str, Any]] = {}
    # fields added without a version bump: left out of the dict at this value, so that every folder made
    # without them keeps its manifest's bytes (a dict without one means this value)
    omitted_at: ClassVar[dict[str, Any]] = {}

    @property
    def targets(self) -> tuple[str, ...]:
        """The components it converts (BACKBONE for the backbone)."""
        return (BACKBONE,)

    @property
    def quantizes_backbone(self) -> bool:
        return BACKBONE in self.targets

    @property
    def searches(self) -> bool:
        """Runs the probe images while it builds (a search against an image-quality target)."""
        return False

    @property
    def probe_count(self) -> int:
        """Calibration prompts the probe images are made from."""
        return 8

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "version": self.version}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in self.omitted_at and v == self.omitted_at[f.name]:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def with_options(cls, options: dict[str, str] | None = None) -> Recipe:
        """Build from command-line strings, each parsed by its field's type."""
        hints = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        values = {}
        for key, raw in (options or {}).items():
            k = key.replace("-", "_")
            if k not in known:
                raise UserError(f"unknown option {key!r} for recipe {cls.name}; options: {', '.join(sorted(known)) or 'none'}")
            values[k] = _parse(hints[k], raw, key)
        return cls(**values)


def _parse(tp, raw: str, key: str):
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return low in ("1", "true", "yes")
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if origin is tuple:
            return tuple(x.strip() for x in raw.split(",") if x.strip())
    except ValueError:
        pass
    name = getattr(tp, "__name__", str(tp))
    raise UserError(f"option {key}={raw!r} is not a valid {name}")


def parse_rotate(value: str) -> int:
    """`none` -> 0 (no rotation), `hadamard` -> DEFAULT_ROTATION_GROUP, `hadamard:G` -> G (one of ROTATION_GROUPS)."""
    kind, _, group = value.partition(":")
    if kind == "none" and not group:
        return 0
    _check(kind == "hadamard", f"rotate must be none, hadamard or hadamard:GROUP; got {value!r}")
    choices = ", ".join(map(str, ROTATION_GROUPS))
    _check(not group or group.isdigit(), f"rotate group must be one of {choices}; got {group!r}")
    g = int(group) if group else DEFAULT_ROTATION_GROUP
    _check(g in ROTATION_GROUPS, f"rotate group must be one of {choices}; got {g}")
    return g


def normalize_components(names: tuple[str, ...]) -> tuple[str, ...]:
    """`-O components=` names with the backbone's aliases (backbone, the family's name) as BACKBONE."""
    return tuple(backbone_key(n) for n in names)


def _build(cls, d: dict, what: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UserError(f"unknown {what} field(s) {', '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    vals = {k: tuple(v) if typing.get_origin(hints[k]) is tuple and isinstance(v, list) else v for k, v in d.items()}
    return cls(**vals)
