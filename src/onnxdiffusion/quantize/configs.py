"""Quantization recipes: typed, versioned dataclasses that validate themselves on construction.

    QuantizeConfig(recipe=Int8StaticRecipe(calibrator="entropy"), calibration=CalibrationConfig(count=32))

Every recipe serializes with ``to_dict`` (``{"name", "version", **fields}``) and comes back with
``recipe_from_dict``; the manifest of a quantized folder stores exactly that dict. Command-line
``-O key=value`` strings are parsed by ``Recipe.with_options`` against the field types, so an
unknown key or an unparsable value is one ``UserError`` before anything runs.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import UserError
from .schedule import ScheduleConfig

CONFIG_VERSION = 1
# ONNX Runtime has no INT8 convolution kernels on CUDA and TensorRT wants its own calibration
# table, so the int8 recipes are CPU-only; MatMulNBits and fp16 also run on CUDA.
INT8_PROVIDERS = ("cpu",)
KNOWN_PROVIDERS = ("cpu", "cuda", "tensorrt", "openvino", "dml", "coreml")
FP16_COMPONENTS = ("unet", "text_encoder", "vae_decoder", "vae_encoder")
MIN_CALIBRATION_PROMPTS = 4
SAMPLER_NAMES = ("ddim", "euler", "euler_a", "dpmpp_2m", "flow_euler", "flow_heun")  # == samplers.SAMPLERS (no import cycle)
# The layers NVIDIA Model Optimizer's diffusers examples leave unquantized (its `filter_func`),
# as node-name patterns; the fp8 / nvfp4 recipes keep them float by default. Measured on the
# embedded UNet (16 held-out pairs): fp8 W8A8 41.7 dB with everything quantized, 43.7 dB without these.
MODELOPT_KEEP_FLOAT = ("*time_emb_proj*", "*time_embedding*", "*conv_in*", "*conv_out*", "*conv_shortcut*",
                       "*add_embedding*", "*pos_embed*", "*time_text_embed*", "*context_embedder*", "*norm_out*",
                       "*x_embedder*", "*patch_embed*")


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

@dataclass(frozen=True)
class Recipe:
    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    calibrated: ClassVar[bool] = False  # needs fp32 sampling trajectories
    quantizes_backbone: ClassVar[bool] = True
    providers: ClassVar[tuple[str, ...]] = INT8_PROVIDERS

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "version": self.version}
        for f in fields(self):
            v = getattr(self, f.name)
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


def _build(cls, d: dict, what: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UserError(f"unknown {what} field(s) {', '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    vals = {k: tuple(v) if typing.get_origin(hints[k]) is tuple and isinstance(v, list) else v for k, v in d.items()}
    return cls(**vals)


@dataclass(frozen=True)
class Fp16Recipe(Recipe):
    """float16 weights and compute, float32 inputs and outputs, per component."""

    name: ClassVar[str] = "fp16"
    providers: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "dml")
    components: tuple[str, ...] = ("unet",)
    op_block_list: tuple[str, ...] = ()  # op types kept in float32 besides ORT's defaults

    def __post_init__(self) -> None:
        _check(len(self.components) > 0, "fp16 needs at least one component")
        for c in self.components:
            _choice("fp16 component", c, FP16_COMPONENTS)
        _check(len(set(self.components)) == len(self.components), "fp16 components listed twice")

    @property
    def quantizes_unet(self) -> bool:
        return "unet" in self.components


@dataclass(frozen=True)
class Int8DynamicRecipe(Recipe):
    """ONNX Runtime dynamic quantization (weights int8 offline, activations at run time)."""

    name: ClassVar[str] = "int8-dynamic"
    op_types: tuple[str, ...] = ("Conv", "MatMul")
    weight_type: str = "uint8"  # measured: int8 weights made ConvInteger 2.2x slower than uint8
    per_channel: bool = False
    keep_float: tuple[str, ...] = ()  # node name patterns (fnmatch) kept in float

    def __post_init__(self) -> None:
        _check(len(self.op_types) > 0, "op_types must not be empty")
        for op in self.op_types:
            _choice("int8-dynamic op type", op, ("Conv", "MatMul", "Gemm"))
        _choice("weight_type", self.weight_type, ("uint8", "int8"))


@dataclass(frozen=True)
class Int8StaticRecipe(Recipe):
    """QDQ int8: per-channel symmetric int8 weights, 8-bit activations calibrated on fp32 trajectories.

    Only Conv, MatMul and Gemm with constant weights are quantized; activation x activation
    MatMuls (attention scores and values) stay float. `calibrator`: minmax | entropy | percentile;
    `aggregation` of per-step ranges: max (the union) | mean (of each step's min and max; minmax only).
    `activation_type` uint8 is the default because ONNX Runtime's x86 kernels fuse every u8-activation
    QDQ Conv (s8 activations left a third of the convolutions unfused and ran slower).
    `float_outputs`: op types whose outputs are not re-quantized (their readers are float ops):
    ORT runs those MatMuls as MatMulIntegerToFloat, saving a Q/DQ pair each (~10% of the call).
    `stored`: cpu-fused (the graph ORT's CPU provider runs, Q/DQ already fused into integer
    kernels and linear biases folded in: faster, ORT-CPU only) | qdq (portable QDQ, fused at load).
    Version 2: cpu-fused became the stored form.
    """

    name: ClassVar[str] = "int8-static"
    version: ClassVar[int] = 2
    calibrated: ClassVar[bool] = True
    calibrator: str = "minmax"
    aggregation: str = "max"
    percentile: float = 99.999
    num_bins: int = 2048
    activation_type: str = "uint8"
    op_types: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
    float_outputs: tuple[str, ...] = ("MatMul", "Gemm")
    keep_float: tuple[str, ...] = ()
    stored: str = "cpu-fused"

    def __post_init__(self) -> None:
        _choice("stored", self.stored, ("cpu-fused", "qdq"))
        _choice("calibrator", self.calibrator, ("minmax", "entropy", "percentile"))
        for op in self.float_outputs:
            _choice("float_outputs op type", op, ("Conv", "MatMul", "Gemm"))
        _choice("aggregation", self.aggregation, ("max", "mean"))
        _check(self.aggregation == "max" or self.calibrator == "minmax",
               f"aggregation 'mean' averages per-step min/max ranges; it needs calibrator minmax, not {self.calibrator}")
        _check(50.0 < self.percentile <= 100.0, f"percentile must be in (50, 100], got {self.percentile}")
        _check(128 <= self.num_bins <= 1 << 16, f"num_bins must be in [128, 65536], got {self.num_bins}")
        _choice("activation_type", self.activation_type, ("uint8", "int8"))
        _check(len(self.op_types) > 0, "op_types must not be empty")
        for op in self.op_types:
            _choice("int8 op type", op, ("Conv", "MatMul", "Gemm"))


@dataclass(frozen=True)
class Int8NaiveRecipe(Int8StaticRecipe):
    """The tutorial baseline: random latents at one timestep and random text embeddings."""

    name: ClassVar[str] = "int8-naive"
    calibrated: ClassVar[bool] = False
    timestep: float = 500.0
    samples: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0.0 <= self.timestep <= 1000.0, f"timestep must be in [0, 1000], got {self.timestep}")
        _check(self.samples >= 2, f"too few calibration samples: need >= 2, got {self.samples}")


@dataclass(frozen=True)
class Int8TimestepRecipe(Int8StaticRecipe):
    """K timestep groups with their own activation scales; weights shared, selected per step in-graph.

    `grouping`: optimal (contiguous groups minimizing the range inflation each step pays for
    sharing scales, by dynamic programming) | equal (equal step counts).
    """

    name: ClassVar[str] = "int8-timestep"
    MAX_GROUPS: ClassVar[int] = 8
    groups: int = 4
    grouping: str = "optimal"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(isinstance(self.groups, int) and 2 <= self.groups <= self.MAX_GROUPS,
               f"groups (K) must be in [2, {self.MAX_GROUPS}], got {self.groups}")
        _choice("grouping", self.grouping, ("optimal", "equal"))
        # QDQ If-branches re-fused at load time ran ~15% slower than the fused ones
        _check(self.stored == "cpu-fused", "int8-timestep stores its groups CPU-fused; stored=qdq is not supported")


@dataclass(frozen=True)
class MixedRecipe(Int8StaticRecipe):
    """int8-static plus the fewest float nodes that reach `target_psnr` (dB, images vs fp32 on probe prompts).

    Nodes are ranked by the error quantizing each one alone adds to the backbone output on
    calibration data (`sensitivity_steps` timesteps spread over the trajectory).
    """

    name: ClassVar[str] = "mixed"
    target_psnr: float = 36.0
    probe_prompts: int = 8
    sensitivity_steps: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(10.0 <= self.target_psnr <= 100.0, f"target_psnr must be in [10, 100] dB, got {self.target_psnr}")
        _check(2 <= self.probe_prompts <= 256, f"probe_prompts must be in [2, 256], got {self.probe_prompts}")
        _check(1 <= self.sensitivity_steps <= 1000, f"sensitivity_steps must be >= 1, got {self.sensitivity_steps}")


@dataclass(frozen=True)
class Int4WeightsRecipe(Recipe):
    """4-bit block-quantized MatMul weights (ONNX Runtime MatMulNBits).

    `others`: float (convolutions and Gemms stay fp32) | int8 (they get int8-static's QDQ,
    calibrated on fp32 trajectories with min/max ranges, stored as int8-static's `stored` says).
    Version 2: `stored`.
    """

    name: ClassVar[str] = "int4-weights"
    version: ClassVar[int] = 2
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0  # 0: ORT default (float compute); 4: int8 compute
    others: str = "float"
    keep_float: tuple[str, ...] = ()
    stored: str = "cpu-fused"

    def __post_init__(self) -> None:
        _choice("stored", self.stored, ("cpu-fused", "qdq"))
        _check(self.block_size in (16, 32, 64, 128, 256), f"block_size must be one of 16, 32, 64, 128, 256; got {self.block_size}")
        _check(self.accuracy_level in (0, 1, 2, 3, 4), f"accuracy_level must be in 0..4, got {self.accuracy_level}")
        _choice("others", self.others, ("float", "int8"))

    @property
    def calibrated(self) -> bool:  # type: ignore[override]
        return self.others == "int8"

    @property
    def providers(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("cpu", "cuda") if self.others == "float" else INT8_PROVIDERS


@dataclass(frozen=True)
class Fp8Recipe(Recipe):
    """FP8 E4M3 QDQ (opset >= 19): weights per output channel, activations per tensor calibrated on
    fp32 sampling trajectories (the union of every step's range). `keep_float`: node-name patterns
    left float (default: Model Optimizer's diffusers exclusions, MODELOPT_KEEP_FLOAT).

    Built for TensorRT (Hopper / Ada FP8 kernels); ONNX Runtime's CPU provider runs the same file as
    float simulation (it has no FP8 kernels), so its quality is measured here and its speed is not.
    """

    name: ClassVar[str] = "fp8"
    calibrated: ClassVar[bool] = True
    providers: ClassVar[tuple[str, ...]] = ("cpu", "tensorrt")
    op_types: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
    keep_float: tuple[str, ...] = MODELOPT_KEEP_FLOAT
    opset: int = 21

    def __post_init__(self) -> None:
        _check(len(self.op_types) > 0, "op_types must not be empty")
        for op in self.op_types:
            _choice("fp8 op type", op, ("Conv", "MatMul", "Gemm"))
        _check(isinstance(self.opset, int) and 19 <= self.opset <= 23, f"fp8 needs opset 19..23, got {self.opset}")


@dataclass(frozen=True)
class Nvfp4Recipe(Recipe):
    """NVFP4 weights (FP4 E2M1, blocks of 16 along the input dimension, E4M3 block scales, a float32
    tensor scale) for TensorRT on Blackwell.

    `activations`: fp16 (left in the compute precision) | fp8 (E4M3 per tensor, calibrated) | fp4
    (dynamic per block at run time: TensorRT's TRT_FP4DynamicQuantize, so form tensorrt only).
    `form`: portable (standard opset-23 Q/DQ) | tensorrt (NVIDIA Model Optimizer's export pattern).
    ONNX Runtime's CPU provider cannot run FLOAT4E2M1 Q/DQ: quality is measured on an fp32 graph
    holding the numpy twin's dequantized weights (and the FP8 activation Q/DQ), which computes what
    the portable file computes.
    """

    name: ClassVar[str] = "nvfp4"
    providers: ClassVar[tuple[str, ...]] = ("cpu", "tensorrt")
    activations: str = "fp8"
    form: str = "portable"
    op_types: tuple[str, ...] = ("MatMul", "Gemm")
    keep_float: tuple[str, ...] = MODELOPT_KEEP_FLOAT

    def __post_init__(self) -> None:
        _choice("activations", self.activations, ("fp16", "fp8", "fp4"))
        _choice("form", self.form, ("portable", "tensorrt"))
        _check(len(self.op_types) > 0, "op_types must not be empty")
        for op in self.op_types:
            _choice("nvfp4 op type", op, ("Conv", "MatMul", "Gemm"))
        _check(self.activations != "fp4" or self.form == "tensorrt",
               "dynamic fp4 activations exist only as TensorRT's TRT_FP4DynamicQuantize: use form=tensorrt")
        _check(self.activations != "fp4" or "Conv" not in self.op_types,
               "dynamic fp4 activations are blocked along the last axis: not for Conv (NCHW) inputs")

    @property
    def calibrated(self) -> bool:  # type: ignore[override]
        return self.activations != "fp16"  # fp4's per-tensor scale is calibrated too


RECIPES: dict[str, type[Recipe]] = {
    r.name: r for r in (Fp16Recipe, Int8DynamicRecipe, Int8StaticRecipe, Int8NaiveRecipe, Int8TimestepRecipe,
                        MixedRecipe, Int4WeightsRecipe, Fp8Recipe, Nvfp4Recipe)
}


def recipe_class(name: str) -> type[Recipe]:
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_from_dict(d: dict) -> Recipe:
    d = dict(d)
    cls = recipe_class(d.pop("name", None))
    version = d.pop("version", None)
    if version != cls.version:
        raise UserError(f"recipe {cls.name} version {version!r} is not supported (this build reads version {cls.version})")
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

    def __post_init__(self) -> None:
        _check(isinstance(self.recipe, Recipe), f"recipe must be a Recipe, got {type(self.recipe).__name__}")
        _choice("provider", self.provider, KNOWN_PROVIDERS)
        if self.provider not in self.recipe.providers:
            why = " (ONNX Runtime has no int8 convolution kernels there)" if self.recipe.providers == INT8_PROVIDERS else ""
            raise UserError(f"recipe {self.recipe.name} cannot run on provider {self.provider}{why}; "
                            f"supported: {', '.join(self.recipe.providers)}")
        if self.correct and not _touches_backbone(self.recipe):
            raise UserError(f"--correct fits the quantized backbone's error; recipe {self.recipe.name} leaves the backbone float")
        _choice("correct_method", self.correct_method, ("trajectory", "output"))
        if self.schedule is not None:
            _check(isinstance(self.schedule, ScheduleConfig), "schedule must be a ScheduleConfig")
            _check(not self.correct, "--precision-schedule and --correct are alternative remedies; pick one")
            _check(_touches_backbone(self.recipe) and not isinstance(self.recipe, Fp16Recipe),
                   f"--precision-schedule switches between a quantized and a float backbone; recipe {self.recipe.name} "
                   f"leaves no quantized backbone")
        _check(isinstance(self.threads, int) and self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        _check(isinstance(self.latency_runs, int) and self.latency_runs >= 1, f"latency_runs must be >= 1, got {self.latency_runs}")

    @property
    def needs_trajectories(self) -> bool:
        return self.recipe.calibrated or self.correct

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


def _touches_backbone(recipe: Recipe) -> bool:
    return not isinstance(recipe, Fp16Recipe) or recipe.quantizes_unet
