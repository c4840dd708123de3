"""The int8 recipes: dynamic, static (QDQ calibrated on sampling trajectories), naive, timestep groups, mixed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .configs_base import BACKBONE, Recipe, _check, _choice, normalize_components, parse_rotate, register

# the components int8-static may quantize besides the backbone (quantize/components.py)
INT8_COMPONENTS = (BACKBONE, "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder")
OP_GROUPS = ("attention", "softmax", "norms", "modulation")  # see opgroups.py
GROUP_CHOICES = ("auto", "int8", "float")
# int8-static's weight linears: calibrated scales, or per-token int8 at run time (symmetric, or with a zero point)
ACTIVATION_CHOICES = ("static", "dynamic-token", "dynamic-token-asym")
# how those per-token linears' int8 weights are rounded: to nearest, or GPTQ (quantize/gptq.py)
WEIGHT_ROUNDINGS = ("nearest", "gptq")

@register
@dataclass(frozen=True)
class Int8DynamicRecipe(Recipe):
    """ONNX Runtime dynamic quantization (weights int8 offline, activations at run time)."""

    name: ClassVar[str] = "int8-dynamic"
    takes_skeleton: ClassVar[bool] = True
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
class Int8Settings:
    """How a QDQ int8 backbone is made: what int8-static, int8-naive, int8-timestep and mixed share
    (each of those recipes is these settings plus its own fields; see Int8StaticRecipe for each field)."""

    calibrator: str = "minmax"
    aggregation: str = "max"
    percentile: float = 99.999
    num_bins: int = 2048
    activation_type: str = "uint8"
    op_types: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
    float_outputs: tuple[str, ...] = ("MatMul", "Gemm")
    keep_float: tuple[str, ...] = ()
    stored: str = "cpu-fused"
    attention: str = "auto"
    softmax: str = "auto"
    norms: str = "auto"
    modulation: str = "auto"
    group_budget: float = 0.25
    smooth_alpha: float = 0.0
    keep_sensitive: float = 0.0
    # none | hadamard[:GROUP]: the quantized linears' inputs group-Hadamard rotated (quantize/rotation.py);
    # added without a version bump: a dict without it means none, and none is left out of the dict
    rotate: str = "none"

    def _check_int8(self) -> None:
        parse_rotate(self.rotate)
        _choice("stored", self.stored, ("cpu-fused", "qdq"))
        _check(math.isfinite(self.keep_sensitive) and 0.0 <= self.keep_sensitive < 1.0,
               f"keep_sensitive must be in [0, 1) (0 = every linear quantized), got {self.keep_sensitive}")
        for group in OP_GROUPS:
            _choice(group, getattr(self, group), GROUP_CHOICES)
        _check(math.isfinite(self.group_budget) and 0.0 <= self.group_budget <= 100.0,
               f"group_budget must be in [0, 100], got {self.group_budget}")
        _check(math.isfinite(self.smooth_alpha) and 0.0 <= self.smooth_alpha < 1.0,
               f"smooth_alpha must be in [0, 1) (0 = no smoothing), got {self.smooth_alpha}")
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


# int8-static's own fields, which the other int8 recipes' dicts carried (always at these values)
# while those recipes were subclasses of it; they also carried its version (and its legacy defaults)
_STATIC_ONLY = {"components": (BACKBONE,), "components_keep_float": ("*conv_out*",), "bias_correction": 0,
                "kernels": "portable", "rounding": "cpu"}
_INT8_VERSION = 8
_INT8_OMITTED = {"rotate": "none"}
_INT8_LEGACY: dict[int, dict] = {2: {"attention": "float", "softmax": "float", "norms": "float", "modulation": "int8",
                                     "smooth_alpha": 0.0, "keep_sensitive": 0.0, **_STATIC_ONLY},
                                 3: {"keep_sensitive": 0.0, **_STATIC_ONLY},
                                 4: dict(_STATIC_ONLY),
                                 5: {"bias_correction": 0, "kernels": "portable", "rounding": "cpu"},
                                 6: {"kernels": "portable", "rounding": "cpu"},
                                 7: {"rounding": "cpu"}}


@register
@dataclass(frozen=True)
class Int8StaticRecipe(Recipe, Int8Settings):
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

    Op groups beyond the weight linears (see `opgroups.py`): `attention` (the score and value
    matmuls; ORT's fused MultiHeadAttention is decomposed to quantize them), `softmax`, `norms`
    (Layer/Instance/Group normalization), `modulation` (linears fed only by the timestep / pooled
    conditioning: adaLN, time embeddings). Each is `int8`, `float` or `auto`: auto groups are
    quantized in order of measured sensitivity (output error each adds alone on calibration
    trajectories) while their summed added error stays within `group_budget` times the error of
    the weight linears that are always quantized. `smooth_alpha` > 0: SmoothQuant-style per-channel
    migration of activation range into the following MatMul weights, calibrated on the same
    trajectories (0 = off). `keep_sensitive` > 0: every weight linear whose quantization alone adds
    more than that share of the output error all quantized linears add together stays float
    (measured on the same calibration feeds; on the MMDiT the patch embedding and the output
    projection: most of the error in a few kilobytes of weights). Version 3: op groups and
    smoothing (a version-2 dict means the old fixed list: modulation int8, the rest float, no
    smoothing). Version 4: `keep_sensitive` (older dicts: 0, every linear quantized).

    `components`: what is quantized: the backbone (`unet`, always) and any of `vae_decoder`,
    `text_encoder`, `text_encoder_2`, `text_encoder_3` (their weight linears int8-static, calibrated
    on the same fp32 runs: quantize/components.py); `components_keep_float`: node-name patterns of
    those components kept float (default: the VAE decoder's conv_out, measured). Version 5: both (older
    dicts: the backbone only).
    `bias_correction` 1: empirical bias correction (Nagel et al. 2019; NNCF's fast bias correction):
    each quantized linear's mean per-output-channel error, measured alone (its int8 twin fed the
    fp32 activations) on the calibration feeds, is subtracted from its bias (bias_correction.py).
    Version 6: `bias_correction` (older dicts: 0, off).
    `kernels` (cpu-fused only): auto | amx | vnni | portable: which ONNX Runtime int8 convolution kernel
    each QLinearConv is laid out for (onnxdiffusion/cpu/int8_lowering.py): auto measures both on this CPU
    per node and keeps the faster; amx puts every one on MLAS's QGEMM (AMX tiles; refused without AMX);
    vnni and portable keep ORT's symmetric conv kernel. Version 7: `kernels` (older dicts: portable).
    `rounding` (cpu-fused only): cpu | portable. portable rewrites the backbone's float kernels that ORT builds
    round differently (norms, GELUs, softmax, attention, QLinearAdd, ...) so that both round alike: float64
    where summation order or exp matter, IEEE-exact float32 elsewhere (quantize/portable_rounding.py); x86
    `generate` and the browser page (onnxruntime-web WASM) then compute the same integers: page vs generate
    went from 33.2-52.6 dB to >= 89 dB on the embedded SD model (export-web refuses rounding=cpu int8-static
    folders unless --allow-drift). Slower on CPU (embedded models, ORT CPU 1 thread: 2.2x the step for SD,
    5.2x for the MMDiT, whose float64 attention softmax dominates).
    Version 8: `rounding` (older dicts: cpu).
    `rotate`: none | hadamard[:GROUP] (16, 64 default, 256): before calibration, every quantizable linear's input
    is rotated by a block-diagonal regular Hadamard matrix (per GROUP channels; a patchify conv's patches) and
    its weight by the inverse offline, so per-channel outliers are spread over their group (quantize/rotation.py,
    docs/recipes/rotation.md). A dict without it means none (none is left out of the dict: older bytes kept).
    `activations`: static (calibrated scales) | dynamic-token | dynamic-token-asym: every weight MatMul / Gemm
    it would quantize (after rotation, when on; float modulation and keep_float excepted) gets per-token int8
    activations measured at run time (symmetric, or -asym: each token's [min, max] with a zero point) and
    int8 per-channel weights, in plain ONNX (ReduceMax, Round, MatMulInteger: quantize/dynamic_token.py);
    calibration is left to what remains static (convs, op groups). A dict without it means static.
    `weights` (with a dynamic-token `activations`): nearest | gptq: how those linears' int8 per-channel weights
    are rounded; gptq pushes each input channel's rounding error onto the channels not yet rounded through the
    inverse Hessian of the linear's float (rotated, when on) input, measured at `gptq_steps` calibration
    timesteps (quantize/gptq.py; the same grid as nearest). A dict without them means nearest, 20.
    """

    name: ClassVar[str] = "int8-static"
    version: ClassVar[int] = _INT8_VERSION
    legacy: ClassVar[dict[int, dict]] = _INT8_LEGACY
    omitted_at: ClassVar[dict] = {**_INT8_OMITTED, "activations": "static", "weights": "nearest", "gptq_steps": 20}
    calibrated: ClassVar[bool] = True
    takes_skeleton: ClassVar[bool] = True
    components: tuple[str, ...] = (BACKBONE,)
    # measured (bench/report_sd15/vae_keep_float.json, embedded model, 64 held-out pairs): the VAE decoder's
    # conv_out kept float lifts its images from 43.2 to 44.9 dB mean (worst 41.8 -> 43.2) for one small conv
    components_keep_float: tuple[str, ...] = ("*conv_out*",)
    bias_correction: int = 0
    kernels: str = "auto"
    rounding: str = "cpu"
    activations: str = "static"
    weights: str = "nearest"
    gptq_steps: int = 20  # every step of the default calibration (8 of 20: 51.36 / 30.54 dB against 20's, issue 44)

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", normalize_components(self.components))
        _choice("activations", self.activations, ACTIVATION_CHOICES)
        _choice("weights", self.weights, WEIGHT_ROUNDINGS)
        _check(self.weights == "nearest" or self.activations != "static",
               "weights=gptq rounds the per-token linears' int8 weights: it needs activations=dynamic-token or dynamic-token-asym")
        _check(isinstance(self.gptq_steps, int) and 1 <= self.gptq_steps <= 1000, f"gptq_steps must be in [1, 1000], got {self.gptq_steps}")
        _choice("kernels", self.kernels, ("auto", "amx", "vnni", "portable"))
        _check(self.kernels in ("auto", "portable") or self.stored == "cpu-fused",
               f"kernels={self.kernels} lays out the CPU-fused graph: it needs stored=cpu-fused")
        _choice("rounding", self.rounding, ("cpu", "portable"))
        _check(self.rounding == "cpu" or self.stored == "cpu-fused",
               f"rounding={self.rounding} rewrites the CPU-fused graph's kernels: it needs stored=cpu-fused")
        for c in self.components:
            _choice("int8-static component", c, INT8_COMPONENTS)
        _check(BACKBONE in self.components, "int8-static always quantizes the backbone: components must include the backbone (backbone, or unet / transformer)")
        _check(len(set(self.components)) == len(self.components), "int8-static components listed twice")
        _check(self.bias_correction in (0, 1), f"bias_correction must be 0 (off) or 1 (on), got {self.bias_correction}")
        self._check_int8()

    @property
    def targets(self) -> tuple[str, ...]:
        return self.components


@register
@dataclass(frozen=True)
class Int8NaiveRecipe(Recipe, Int8Settings):
    """The tutorial baseline: random latents at one timestep and random text embeddings."""

    name: ClassVar[str] = "int8-naive"
    random_calibration: ClassVar[bool] = True
    takes_skeleton: ClassVar[bool] = True
    version: ClassVar[int] = _INT8_VERSION
    legacy: ClassVar[dict[int, dict]] = _INT8_LEGACY
    omitted_at: ClassVar[dict] = _INT8_OMITTED
    retired: ClassVar[dict] = _STATIC_ONLY
    timestep: float = 500.0
    samples: int = 64
    # the tutorial's fixed list: random data has no fp32 outputs to measure sensitivity against
    attention: str = "float"
    softmax: str = "float"
    norms: str = "float"
    modulation: str = "int8"

    def __post_init__(self) -> None:
        self._check_int8()
        _check("auto" not in {getattr(self, g) for g in OP_GROUPS} and self.smooth_alpha == 0.0 and self.keep_sensitive == 0.0,
               "int8-naive calibrates on random data: op groups must be int8 or float, smooth_alpha and keep_sensitive 0")
        _check(0.0 <= self.timestep <= 1000.0, f"timestep must be in [0, 1000], got {self.timestep}")
        _check(self.samples >= 2, f"too few calibration samples: need >= 2, got {self.samples}")


@register
@dataclass(frozen=True)
class Int8TimestepRecipe(Recipe, Int8Settings):
    """K timestep groups with their own activation scales; weights shared, selected per step in-graph.

    `grouping`: optimal (contiguous groups minimizing the range inflation each step pays for
    sharing scales, by dynamic programming) | equal (equal step counts).
    """

    name: ClassVar[str] = "int8-timestep"
    calibrated: ClassVar[bool] = True
    takes_skeleton: ClassVar[bool] = True
    version: ClassVar[int] = _INT8_VERSION
    legacy: ClassVar[dict[int, dict]] = _INT8_LEGACY
    omitted_at: ClassVar[dict] = _INT8_OMITTED
    retired: ClassVar[dict] = _STATIC_ONLY
    MAX_GROUPS: ClassVar[int] = 8
    groups: int = 4
    grouping: str = "optimal"

    def __post_init__(self) -> None:
        self._check_int8()
        _check(isinstance(self.groups, int) and 2 <= self.groups <= self.MAX_GROUPS,
               f"groups (K) must be in [2, {self.MAX_GROUPS}], got {self.groups}")
        _choice("grouping", self.grouping, ("optimal", "equal"))
        # QDQ If-branches re-fused at load time ran ~15% slower than the fused ones
        _check(self.stored == "cpu-fused", "int8-timestep stores its groups CPU-fused; stored=qdq is not supported")


@register
@dataclass(frozen=True)
class MixedRecipe(Recipe, Int8Settings):
    """int8-static plus the fewest float nodes that reach `target_psnr` (dB, images vs fp32 on probe prompts).

    Nodes are ranked by the error quantizing each one alone adds to the backbone output on
    calibration data (`sensitivity_steps` timesteps spread over the trajectory).
    """

    name: ClassVar[str] = "mixed"
    calibrated: ClassVar[bool] = True
    takes_skeleton: ClassVar[bool] = True
    version: ClassVar[int] = _INT8_VERSION
    legacy: ClassVar[dict[int, dict]] = _INT8_LEGACY
    omitted_at: ClassVar[dict] = _INT8_OMITTED
    retired: ClassVar[dict] = _STATIC_ONLY
    target_psnr: float = 36.0
    probe_prompts: int = 8
    sensitivity_steps: int = 4

    def __post_init__(self) -> None:
        self._check_int8()
        _check(10.0 <= self.target_psnr <= 100.0, f"target_psnr must be in [10, 100] dB, got {self.target_psnr}")
        _check(2 <= self.probe_prompts <= 256, f"probe_prompts must be in [2, 256], got {self.probe_prompts}")
        _check(1 <= self.sensitivity_steps <= 1000, f"sensitivity_steps must be >= 1, got {self.sensitivity_steps}")

    @property
    def searches(self) -> bool:
        return True

    @property
    def probe_count(self) -> int:
        return self.probe_prompts

