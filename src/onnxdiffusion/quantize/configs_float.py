"""The other recipes: float16, 4-bit weights (MatMulNBits), and TensorRT's low-bit floats (FP8, NVFP4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .configs_base import (BACKBONE, FP16_COMPONENTS, INT4_ALGORITHMS, INT8_PROVIDERS, MODELOPT_KEEP_FLOAT, Recipe, _check,
                           _choice, normalize_components, parse_rotate, register)


@register
@dataclass(frozen=True)
class Fp16Recipe(Recipe):
    """float16 weights and compute, float32 inputs and outputs, per component."""

    name: ClassVar[str] = "fp16"
    quantizes: ClassVar[bool] = False
    takes_skeleton: ClassVar[bool] = True
    providers: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "dml")
    components: tuple[str, ...] = (BACKBONE,)
    op_block_list: tuple[str, ...] = ()  # op types kept in float32 besides ORT's defaults

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", normalize_components(self.components))
        _check(len(self.components) > 0, "fp16 needs at least one component")
        for c in self.components:
            _choice("fp16 component", c, FP16_COMPONENTS)
        _check(len(set(self.components)) == len(self.components), "fp16 components listed twice")

    @property
    def targets(self) -> tuple[str, ...]:
        return self.components


@register
@dataclass(frozen=True)
class Int4WeightsRecipe(Recipe):
    """4-bit block-quantized MatMul weights (ONNX Runtime MatMulNBits).

    `others`: float (convolutions and Gemms stay fp32) | int8 (they get int8-static's QDQ,
    calibrated on fp32 trajectories with min/max ranges, stored as int8-static's `stored` says).
    `gemms`: int4 (constant-weight Gemms, the adaLN / time-embedding linears, are rewritten as
    MatMul + Add and get 4-bit weights too: on an MMDiT they hold a third of the weight bytes) |
    keep (they stay Gemm: float, or int8 under others=int8).
    `accuracy_level` 4 makes MatMulNBits quantize its activations to int8 per block at run time
    (W4A8 compute); 0 computes in float.
    `target_ratio` > 0: the MatMuls whose 4-bit weights add the most output error per byte saved
    (each measured alone on calibration trajectories) get 8-bit MatMulNBits weights instead, most
    costly first, while the backbone stays >= target_ratio x smaller than fp32 (0: all 4-bit).
    `algorithm`: how each block's scale (and zero point) is found, all by ONNX Runtime's weight-only
    quantizers: default (min/max round-to-nearest; `symmetric` picks int4 with zero point 8 or a
    per-block zero point) | hqq (Half-Quadratic Quantization: float zero points fitted by a proximal
    solver; asymmetric, `symmetric` ignored; needs torch at quantize time, not at run time) | gptq (GPTQ:
    rounding error compensated through the input activations' Hessian from the calibration trajectories,
    `gptq_steps` timesteps of them; symmetric; numpy; the whole backbone in memory, so < 2 GB only) | gptq-clip
    (GPTQ written here, quantize/gptq.py: each block's grid by a clip-ratio search, `symmetric` as given; the
    Hessians from `gptq_steps` timesteps of the calibration trajectories through the graph quantized, rotated
    under `rotate`; numpy; < 2 GB only). Rotated W4A8 on the MMDiT (backbone SQNR, 32 calibration prompts):
    default 17.0 dB, ORT's gptq 13.9 dB, gptq-clip asymmetric 23.6 dB.
    Measured on the MMDiT (32 held-out pairs, all 4-bit, bench/results/int4_algorithms.md): default 28.4 dB,
    hqq 29.9 dB (32-blocks, but float zero points: 3.50x instead of 3.92x smaller), gptq 28.0 dB in 6 min;
    with target_ratio=3.5, asymmetric 64-blocks (all 4-bit 4.06x, so more layers fit 8-bit) 37.2 dB on 128 pairs.
    Version 2: `stored`. Version 3: `gemms`, `target_ratio` (a version-2 dict means gemms=keep).
    Version 4: `algorithm`, `gptq_steps` (older dicts mean default).
    `rotate`: none | hadamard[:GROUP]: every 4-bit MatMul's input group-Hadamard rotated, its weight
    rotated before the blocks are quantized (quantize/rotation.py); a dict without it means none.
    `weights_8bit`: node-name patterns (fnmatch, as keep_float) of MatMuls (Gemms under gemms=int4) given 8-bit
    MatMulNBits weights (min/max rounding), chosen by the user, besides any target_ratio picks; a pattern
    matching none is an error. A dict without it means none (every older folder keeps its manifest's bytes).
    """

    name: ClassVar[str] = "int4-weights"
    takes_skeleton: ClassVar[bool] = True
    version: ClassVar[int] = 4
    legacy: ClassVar[dict[int, dict]] = {2: {"gemms": "keep", "algorithm": "default"}, 3: {"algorithm": "default"}}
    omitted_at: ClassVar[dict] = {"rotate": "none", "weights_8bit": ()}
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0  # 0: ORT default (float compute); 4: int8 compute
    others: str = "float"
    keep_float: tuple[str, ...] = ()
    stored: str = "cpu-fused"
    gemms: str = "int4"
    target_ratio: float = 0.0
    algorithm: str = "default"
    gptq_steps: int = 8
    rotate: str = "none"
    weights_8bit: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_rotate(self.rotate)
        _choice("gemms", self.gemms, ("int4", "keep"))
        _choice("algorithm", self.algorithm, INT4_ALGORITHMS)
        _check(isinstance(self.gptq_steps, int) and 1 <= self.gptq_steps <= 1000, f"gptq_steps must be in [1, 1000], got {self.gptq_steps}")
        _check(self.target_ratio == 0.0 or 1.0 <= self.target_ratio <= 8.0,
               f"target_ratio must be 0 (all 4-bit) or in [1, 8], got {self.target_ratio}")
        _choice("stored", self.stored, ("cpu-fused", "qdq"))
        _check(self.block_size in (16, 32, 64, 128, 256), f"block_size must be one of 16, 32, 64, 128, 256; got {self.block_size}")
        _check(self.accuracy_level in (0, 1, 2, 3, 4), f"accuracy_level must be in 0..4, got {self.accuracy_level}")
        _choice("others", self.others, ("float", "int8"))

    @property
    def calibrated(self) -> bool:  # type: ignore[override]
        return self.others == "int8" or self.target_ratio > 0 or self.algorithm in ("gptq", "gptq-clip")

    @property
    def providers(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("cpu", "cuda") if self.others == "float" else INT8_PROVIDERS


@register
@dataclass(frozen=True)
class W4A8Recipe(Int4WeightsRecipe):
    """4-bit weights, int8 activations, Hadamard-rotated: int4-weights with `rotate=hadamard` (the
    quantized MatMuls' inputs group-rotated, their weights rotated before 4-bit block quantization) and
    MatMulNBits `accuracy_level=4` (activations quantized to int8 per block at run time: int8 compute).
    For the memory-bound large backbones, where 4-bit weights halve int8's bytes read per step."""

    name: ClassVar[str] = "w4a8"
    version: ClassVar[int] = 1
    legacy: ClassVar[dict[int, dict]] = {}
    omitted_at: ClassVar[dict] = {"weights_8bit": ()}
    accuracy_level: int = 4
    rotate: str = "hadamard"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.accuracy_level == 4, f"w4a8 computes with int8 activations: accuracy_level must be 4, got {self.accuracy_level}")


@register
@dataclass(frozen=True)
class WeightsOnlyRecipe(Recipe):
    """Weight-only MatMulNBits at `bits` (8 or 4) on the components named, by default the text encoder alone: the
    LLM text encoders (Qwen-Image's, Z-Image's) are as big as the backbone, and their q/k/v/o and MLP projections
    are MatMuls with constant weights. Every such MatMul whose weight holds at least a block is converted (min/max
    rounding, symmetric blocks of `block_size` along the input axis, ONNX Runtime's default weight-only
    quantizer, as int4-weights' `algorithm=default`); embeddings, convolutions and Gemms stay float. No calibration.
    `accuracy_level` 4 computes in int8 (W4A8/W8A8); 0 in float. `gemms` quantize: constant-weight Gemms are
    rewritten as MatMul (+ Add) and converted too (a VL text encoder's vision tower runs its linears as Gemms over
    patch rows); keep (the default, left out of the recipe's dict): they stay float Gemms."""

    name: ClassVar[str] = "weights-only"
    quantizes: ClassVar[bool] = True
    takes_skeleton: ClassVar[bool] = True
    providers: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    components: tuple[str, ...] = ("text_encoder",)
    bits: int = 8
    block_size: int = 32
    accuracy_level: int = 0
    gemms: str = "keep"
    omitted_at: ClassVar[dict] = {"gemms": "keep"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", normalize_components(self.components))
        _check(len(self.components) > 0, "weights-only needs at least one component")
        _choice("gemms", self.gemms, ("keep", "quantize"))
        for c in self.components:
            _choice("weights-only component", c, WEIGHTS_ONLY_COMPONENTS)
        _check(len(set(self.components)) == len(self.components), "weights-only components listed twice")
        _check(self.bits in (4, 8), f"bits must be 4 or 8, got {self.bits}")
        _check(self.block_size in (16, 32, 64, 128, 256), f"block_size must be one of 16, 32, 64, 128, 256; got {self.block_size}")
        _check(self.accuracy_level in (0, 1, 2, 3, 4), f"accuracy_level must be in 0..4, got {self.accuracy_level}")

    @property
    def targets(self) -> tuple[str, ...]:
        return self.components


WEIGHTS_ONLY_COMPONENTS = (BACKBONE, "text_encoder", "text_encoder_2", "text_encoder_3")


KEEP_16BIT = ("auto", "none")


@dataclass(frozen=True)
class LowbitRecipe(Recipe):
    """What fp8 and nvfp4 share: layers kept 16-bit, chosen by measured sensitivity (version 2).

    `keep_16bit` auto: if the probe images (the first `probe_prompts` calibration prompts and seeds,
    full sampling runs vs fp32) miss `target_psnr` with every candidate quantized, each candidate
    linear is quantized alone and the output error it adds on `sensitivity_steps` timesteps of the
    calibration trajectories is measured; the linears are ranked by that error per weight byte and
    the smallest prefix of the ranking whose 16-bit copy reaches the target is kept 16-bit (float16
    weights; inputs in the compute precision), within `max_16bit` (the largest fraction of the
    candidates' weight bytes that may stay 16-bit; when the target is out of reach the whole budget
    is spent and the report says so). none: every candidate quantized (version 1's recipe).
    `target_psnr` 0: the format's level (fp8 40 dB; nvfp4 with fp16 activations 30, with fp8 27).
    `margin_db`: the probe must clear the target by this much. The probe prompts are the calibration
    prompts the ranking was measured on, so a set chosen on them reads high: on the MMDiT, fp8 layers
    that brought the probe to 41.7 dB gave 39.6 dB on 128 held-out pairs (bench/results/lowbit.md).
    """

    version: ClassVar[int] = 2
    legacy: ClassVar[dict[int, dict]] = {1: {"keep_16bit": "none"}}
    keep_16bit: str = "auto"
    target_psnr: float = 0.0
    max_16bit: float = 0.5
    margin_db: float = 2.0
    probe_prompts: int = 32
    sensitivity_steps: int = 4

    def _check_keep(self) -> None:
        _choice("keep_16bit", self.keep_16bit, KEEP_16BIT)
        _check(isinstance(self.target_psnr, (int, float)) and (self.target_psnr == 0 or 10.0 <= self.target_psnr <= 100.0),
               f"target_psnr must be 0 (the format's level) or in [10, 100] dB, got {self.target_psnr}")
        _check(isinstance(self.max_16bit, (int, float)) and 0.0 <= self.max_16bit <= 1.0,
               f"max_16bit is a fraction of the quantized layers' weight bytes: must be in [0, 1], got {self.max_16bit}")
        _check(isinstance(self.margin_db, (int, float)) and 0.0 <= self.margin_db <= 20.0,
               f"margin_db must be in [0, 20] dB, got {self.margin_db}")
        _check(isinstance(self.probe_prompts, int) and 2 <= self.probe_prompts <= 256,
               f"probe_prompts must be in [2, 256], got {self.probe_prompts}")
        _check(isinstance(self.sensitivity_steps, int) and 1 <= self.sensitivity_steps <= 1000,
               f"sensitivity_steps must be in [1, 1000], got {self.sensitivity_steps}")

    @property
    def level_db(self) -> float:  # the format's quality level (issue 13's acceptance)
        return 40.0

    @property
    def target_db(self) -> float:
        return float(self.target_psnr) or self.level_db

    @property
    def searches(self) -> bool:
        """Whether a 16-bit set is searched for (needs calibration trajectories and the probe)."""
        return self.keep_16bit == "auto"

    @property
    def probe_count(self) -> int:
        return self.probe_prompts


@register
@dataclass(frozen=True)
class Fp8Recipe(LowbitRecipe):
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
        self._check_keep()


@register
@dataclass(frozen=True)
class Nvfp4Recipe(LowbitRecipe):
    """NVFP4 weights (FP4 E2M1, blocks of 16 along the input dimension, E4M3 block scales, a float32
    tensor scale) for TensorRT on Blackwell.

    `activations`: fp16 (left in the compute precision) | fp8 (E4M3 per tensor, calibrated) | fp4
    (dynamic per block at run time: TensorRT's TRT_FP4DynamicQuantize, so form tensorrt only).
    `form`: portable (standard opset-23 Q/DQ) | tensorrt (NVIDIA Model Optimizer's export pattern).
    ONNX Runtime's CPU provider cannot run FLOAT4E2M1 Q/DQ: quality is measured on an fp32 graph
    holding the numpy twin's dequantized weights (and the FP8 activation Q/DQ), which computes what
    the portable file computes. 16-bit layers: see LowbitRecipe (with fp4 activations, which have
    no CPU simulation, auto keeps none).
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
        self._check_keep()

    @property
    def level_db(self) -> float:  # type: ignore[override]
        return 30.0 if self.activations == "fp16" else 27.0

    @property
    def searches(self) -> bool:  # type: ignore[override]
        return self.keep_16bit == "auto" and self.activations != "fp4"  # dynamic FP4 has no CPU simulation

    @property
    def calibrated(self) -> bool:  # type: ignore[override]
        return self.activations != "fp16" or self.searches  # fp4's per-tensor scale is calibrated too

