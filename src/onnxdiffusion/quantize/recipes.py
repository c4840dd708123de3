"""One builder per recipe: fp32 backbone (+ calibration data) in, quantized components out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import onnx

from ..errors import UserError
from . import _ort, files
from .calibration import CalibrationSet, group_boundaries, histogram_ranges, step_ranges, timestep_groups
from .configs import (
    BACKBONE,
    Fp8Recipe,
    Fp16Recipe,
    Int4WeightsRecipe,
    Int8DynamicRecipe,
    Int8NaiveRecipe,
    Int8StaticRecipe,
    Int8TimestepRecipe,
    MixedRecipe,
    Nvfp4Recipe,
    QuantizeConfig,
    Recipe,
    W4A8Recipe,
    WeightsOnlyRecipe,
)
from .graphs import (  # noqa: F401 - prepare_unet re-exported: importers find it here
    activation_tensors,
    prepare_unet,
    compact_names,
    name_nodes,
    peer_float_nodes,
    quantizable_nodes,
    reroute_shape_reads,
)
from .components import CPU_STORED_AS, quantize_component, stored_graph
from .runner import ImageProbe
from .static_plan import StaticPlan, plan_static, selection
from .timestep_graphs import merge_timestep_groups


@dataclass
class Context:
    """What a builder may use; calibration data and the probe are made on first use."""

    config: QuantizeConfig
    unet: onnx.ModelProto  # fp32, shape-inferred, every node named
    components: dict[str, onnx.ModelProto]  # fp32 components other than the unet, loaded on demand
    get_calibration: Callable[[], CalibrationSet]
    get_probe: Callable[[], ImageProbe]
    log: Callable[[str], None]
    # calibration feeds of a component other than the backbone (components.calibration_feeds)
    component_feeds: Callable[[str], list[dict]] | None = None

    @property
    def threads(self) -> int:
        return self.config.threads


@dataclass
class Built:
    """A builder's output: the new components and what the folder and the report say about them."""

    components: dict[str, onnx.ModelProto]  # name (BACKBONE for the backbone) -> new model
    precision: str
    float_nodes: list[str] = field(default_factory=list)
    quantized_nodes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # for the report only: what was measured and decided
    # what quality is measured on when ORT's CPU provider cannot run the stored backbone (FLOAT4E2M1)
    simulation: onnx.ModelProto | None = None
    cpu_runnable: bool = True
    stored_as: str | None = None  # the stored graph's form (a provider-specific graph, not portable QDQ)
    requires_provider: str | None = None  # the only provider whose kernels run the stored backbone
    timestep_groups: dict | None = None  # {"boundaries", "groups"}: the backbone switches scales per step
    quality_measured_on: str | None = None  # when quality is measured on a simulation, which
    simulated_on_cpu: bool = False  # ORT's CPU provider runs the stored form as float simulation

    @property
    def backbone(self) -> onnx.ModelProto | None:
        return self.components.get(BACKBONE)

    def report_details(self) -> dict:
        """`details` with the typed fields, as the report has always shown them."""
        typed = {"stored_as": self.stored_as, "requires_provider": self.requires_provider,
                 "simulated_on_cpu": self.simulated_on_cpu or None, "quality_measured_on": self.quality_measured_on}
        if self.timestep_groups is not None:
            typed.update(self.timestep_groups)
        return {**{k: v for k, v in typed.items() if v is not None}, **self.details}


BUILDERS: dict[type[Recipe], Callable[[Context, Recipe], Built]] = {}


def builds(recipe_type: type[Recipe]):
    """Register a function as the builder of one recipe class."""
    def register(fn):
        BUILDERS[recipe_type] = fn
        return fn
    return register


# --- int8 static family ----------------------------------------------------------------------

def _selection(ctx: Context, recipe, op_types) -> tuple[list[str], list[str]]:
    return selection(ctx.unet, recipe, op_types)


def _ranges(ctx: Context, recipe: Int8StaticRecipe, calib: CalibrationSet, plan: StaticPlan, steps=None) -> dict[str, tuple[float, float]]:
    if recipe.calibrator == "minmax":
        return plan.stats.aggregate(steps, recipe.aggregation)
    return histogram_ranges(plan.model, plan.tensors, plan.stats, calib, recipe.calibrator, recipe.num_bins,
                            recipe.percentile, steps=steps, threads=ctx.threads)


def _qdq(ctx: Context, recipe: Int8StaticRecipe, plan: StaticPlan, ranges, nodes=None) -> onnx.ModelProto:
    model = _ort.qdq_quantize(plan.model, ranges, plan.nodes if nodes is None else nodes, plan.op_types,
                              recipe.activation_type, recipe.float_outputs)
    reroute_shape_reads(model)
    return compact_names(model)


def stored_form(ctx: Context, recipe: Int8StaticRecipe | Int4WeightsRecipe, model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """The backbone as the recipe stores it, and a description for the manifest.

    `model` is a QDQ graph with compact names already (see `_qdq`)."""
    return stored_graph(model, recipe.stored, ctx.threads)


@builds(Int8StaticRecipe)
def build_static(ctx: Context, recipe: Int8StaticRecipe) -> Built:
    return _build_qdq(ctx, recipe, bool(recipe.bias_correction))


def _build_qdq(ctx: Context, recipe: Int8StaticRecipe | Int8NaiveRecipe, bias_correction: bool) -> Built:
    calib = ctx.get_calibration()
    plan = plan_static(ctx, recipe, calib)
    ranges = _ranges(ctx, recipe, calib, plan)
    if bias_correction and plan.nodes:  # nothing static (activations=dynamic-token, convs float): no bias to correct
        from .bias_correction import correct_biases

        def quantized(model):
            return _ort.qdq_quantize(model, ranges, plan.nodes, plan.op_types, recipe.activation_type, recipe.float_outputs)

        plan.model, plan.details["bias_correction"] = correct_biases(plan.model, quantized, plan.nodes, calib, ctx.threads, ctx.log)
    # no static node left (activations=dynamic-token, convs float): the graph is stored as planned
    model, stored = stored_form(ctx, recipe, _qdq(ctx, recipe, plan, ranges) if plan.nodes else compact_names(plan.model))
    kernels = getattr(recipe, "kernels", "portable")  # int8-static's option; int8-naive has none
    if recipe.stored == "cpu-fused" and kernels != "portable":  # conv kernels for this CPU (AMX: QGEMM)
        from .amx_lowering import apply

        plan.details["int8_kernels"] = apply(ctx, kernels, model)
    if getattr(recipe, "rounding", "cpu") == "portable":  # the same integers on every ORT build (WASM too)
        from .portable_rounding import portable_rounding

        plan.details["portable_rounding"] = portable_rounding(model)
    built = Built({BACKBONE: model}, recipe.name, float_nodes=plan.kept, quantized_nodes=plan.dynamic + plan.nodes,
                  details={"calibrated_tensors": len(plan.tensors), **plan.details}, stored_as=stored)
    for name in recipe.targets:
        if name != BACKBONE:  # the VAE decoder, text encoders: quantize/components.py
            ctx.log(f"int8-static: {name}")
            built.components[name], built.details.setdefault("components", {})[name] = quantize_component(
                ctx.components[name], ctx.component_feeds(name), recipe.components_keep_float, ctx.threads, recipe.stored)
    return built


@builds(Int8NaiveRecipe)
def build_naive(ctx: Context, recipe: Int8NaiveRecipe) -> Built:
    return _build_qdq(ctx, recipe, False)  # the difference is all in the calibration set


@builds(Int8TimestepRecipe)
def build_timestep(ctx: Context, recipe: Int8TimestepRecipe) -> Built:
    calib = ctx.get_calibration()
    if recipe.groups > calib.num_steps:
        raise UserError(f"groups (K={recipe.groups}) must not exceed the {calib.num_steps} calibration steps")
    plan = plan_static(ctx, recipe, calib)
    groups = timestep_groups(plan.stats, recipe.groups, recipe.grouping)
    bounds = group_boundaries(calib.timesteps, groups)
    models = [_qdq(ctx, recipe, plan, _ranges(ctx, recipe, calib, plan, steps=g)) for g in groups]
    # Each group is stored as the graph ORT's CPU provider runs after fusing its Q/DQ pairs: the
    # per-call cost of the If switch then stays at int8-static's level (QDQ branches re-fused at
    # load time ran ~15% slower). Weights are byte-identical across groups and stored once.
    merged = merge_timestep_groups([stored_form(ctx, recipe, m)[0] for m in models], bounds)
    shared = sum(len(t.raw_data) or t.ByteSize() for t in merged.graph.initializer)
    spans = [[float(calib.timesteps[g[0]]), float(calib.timesteps[g[-1]])] for g in groups]
    return Built({BACKBONE: merged}, recipe.name, float_nodes=plan.kept, quantized_nodes=plan.nodes, details={
        "shared_initializer_bytes": int(shared),
        "single_group_qdq_bytes": int(files.model_bytes(models[0])),
        "calibrated_tensors": len(plan.tensors),
        **plan.details,
    }, stored_as=CPU_STORED_AS + ", one If branch per group", timestep_groups={
        "boundaries": bounds, "groups": [{"steps": g, "t_from": s[0], "t_to": s[1]} for g, s in zip(groups, spans)]})


@builds(MixedRecipe)
def build_mixed(ctx: Context, recipe: MixedRecipe) -> Built:
    from .sensitivity import choose_float_nodes

    calib = ctx.get_calibration()
    plan = plan_static(ctx, recipe, calib)
    nodes = plan.nodes
    ranges = _ranges(ctx, recipe, calib, plan)

    def quantize_without(float_nodes: set[str]) -> onnx.ModelProto:
        return _qdq(ctx, recipe, plan, ranges, [n for n in nodes if n not in float_nodes])

    def quantize_only(node: str) -> onnx.ModelProto:
        return _ort.qdq_quantize(plan.model, ranges, [node], plan.op_types, recipe.activation_type, recipe.float_outputs)

    result = choose_float_nodes(ctx, recipe, calib, nodes, quantize_only, quantize_without)
    model, stored = stored_form(ctx, recipe, quantize_without(set(result["float_nodes"])))
    peers = peer_float_nodes(plan.model, nodes)
    peer_all = sorted({n for v in peers.values() for n in v})
    peer_model = quantize_without(set(peer_all))
    probe = ctx.get_probe()
    result["peer_hand_list"] = {"by_category": peers, "count": len(peer_all),
                                "probe_psnr_db": probe.psnr(peer_model),
                                "overlap_with_ours": sorted(set(peer_all) & set(result["float_nodes"]))}
    return Built({BACKBONE: model}, recipe.name, float_nodes=plan.kept + result["float_nodes"],
                 quantized_nodes=[n for n in nodes if n not in set(result["float_nodes"])], details={**plan.details, **result},
                 stored_as=stored)


# --- the others ------------------------------------------------------------------------------

@builds(Int8DynamicRecipe)
def build_dynamic(ctx: Context, recipe: Int8DynamicRecipe) -> Built:
    nodes, kept = _selection(ctx, recipe, recipe.op_types)
    model = _ort.dynamic_quantize(ctx.unet, nodes, recipe.op_types, recipe.weight_type, recipe.per_channel)
    return Built({BACKBONE: model}, recipe.name, float_nodes=kept, quantized_nodes=nodes)


@builds(W4A8Recipe)
@builds(Int4WeightsRecipe)
def build_int4(ctx: Context, recipe: Int4WeightsRecipe) -> Built:
    from .opgroups import gemms_as_matmuls
    from .rotation import parse_rotate, rotate_linears
    from .static_plan import _infer

    base, rewritten, rotation = ctx.unet, [], None
    if recipe.gemms == "int4":
        gemms = [q.name for q in quantizable_nodes(base, ("Gemm",), recipe.keep_float)]
        base, rewritten = gemms_as_matmuls(base, gemms)
        base = _infer(base)
    if parse_rotate(recipe.rotate):  # 4-bit MatMuls (and the Gemms under others=int8) read rotated inputs
        ops = ("MatMul", "Gemm") if recipe.others == "int8" else ("MatMul",)  # float Gemms gain nothing
        linears = [q.name for q in quantizable_nodes(base, ops, recipe.keep_float)]
        base, rotation = rotate_linears(base, linears, parse_rotate(recipe.rotate))
        base = _infer(base)
    every = quantizable_nodes(base, ("MatMul",))
    chosen = [q for q in quantizable_nodes(base, ("MatMul",), recipe.keep_float) if q.weight_size >= recipe.block_size]
    if not chosen:
        raise UserError("int4-weights: no MatMul with a constant weight to quantize")
    names = [q.name for q in chosen]

    def nbits(model, nodes, bits):
        # 8-bit weights always by min/max rounding: ORT's CPU MatMulNBits has no 8-bit kernel with HQQ's float zero points
        algorithm = "default" if recipe.algorithm in ("gptq", "gptq-clip") or bits == 8 else recipe.algorithm
        return _ort.int4_quantize(model, nodes, recipe.block_size, recipe.symmetric, recipe.accuracy_level, bits, algorithm)

    details = {"gemms_as_int4_matmuls": len(rewritten), "accuracy_level": recipe.accuracy_level,
               "algorithm": recipe.algorithm, **({"rotation": rotation} if rotation else {})}
    others = [q.name for q in quantizable_nodes(base, ("Conv", "Gemm"), recipe.keep_float)]
    float_nodes = [q.name for q in every if q.name not in set(names)]
    ranges = None
    if recipe.others == "int8" and others:  # calibrated first: the fp32 stats session and the int4 model never coexist
        tensors = activation_tensors(base, others)
        ranges = step_ranges(base, tensors, ctx.get_calibration(), ctx.threads).aggregate(None, "max")
    eight: list[str] = []
    if recipe.target_ratio > 0:
        from .sensitivity import choose_8bit_weights

        fp32 = onnx.ModelProto()
        fp32.CopyFrom(ctx.unet)
        del fp32.graph.value_info[:]  # as stored: the shape inference is ours
        details["weights_8bit"] = choose_8bit_weights(ctx, base, names, ctx.get_calibration(), nbits,
                                                      fp32.ByteSize(), recipe.target_ratio)
        eight = details["weights_8bit"]["int8_weights"]
    if recipe.weights_8bit:
        from .sensitivity import named_8bit_weights

        named = named_8bit_weights(names, recipe.weights_8bit)
        details["weights_8bit_named"] = named
        eight = eight + [n for n in named if n not in set(eight)]
    model = nbits(base, eight, 8) if eight else base
    four = [n for n in names if n not in set(eight)]
    if recipe.algorithm == "gptq":  # the 8-bit ones (and the ranking above) stay round-to-nearest
        calib = ctx.get_calibration()
        steps = calib.spread_steps(recipe.gptq_steps)
        model = _ort.gptq_int4_quantize(model, four, recipe.block_size, recipe.accuracy_level,
                                        (feed for _, feed in calib.feeds(steps)))
        details["gptq_timesteps"] = len(steps)
    elif recipe.algorithm == "gptq-clip":
        from .gptq import gptq_clip_quantize

        model, details["gptq_timesteps"] = gptq_clip_quantize(base, model, four, ctx.get_calibration(), recipe, ctx.threads)
    else:
        model = nbits(model, four, 4)
    if ranges is not None:
        model = files.infer_shapes(model)
        model = _ort.qdq_quantize(model, ranges, others, ("Conv", "Gemm"), "uint8", ("Gemm",), owned=True)
        reroute_shape_reads(model)
        model, stored = stored_form(ctx, recipe, compact_names(model))
        return Built({BACKBONE: model}, "int4-weights+int8", float_nodes=float_nodes, quantized_nodes=names + others,
                     details={**details, "int8_convs_and_gemms": len(others)}, stored_as=stored)
    model = files.with_weights(model)  # a skeleton's float weights, read for saving (the 4-bit ones are in memory)
    return Built({BACKBONE: model}, "int4-weights+int8" if recipe.others == "int8" else recipe.name,
                 float_nodes=float_nodes + others, quantized_nodes=names, details={**details, "float_convs_and_gemms": len(others)})


@builds(WeightsOnlyRecipe)
def build_weights_only(ctx: Context, recipe: WeightsOnlyRecipe) -> Built:
    out, quantized, kept = {}, [], []
    for name in recipe.targets:
        src = ctx.unet if name == BACKBONE else ctx.components[name]
        if recipe.gemms == "quantize":  # no shape inference after: its value_info would outweigh the saving
            from .opgroups import gemms_as_matmuls

            src = gemms_as_matmuls(src, [q.name for q in quantizable_nodes(src, ("Gemm",))])[0]
        nodes = quantizable_nodes(src, ("MatMul",))
        chosen = [q.name for q in nodes if q.weight_size >= recipe.block_size]
        if not chosen:
            raise UserError(f"weights-only: {name} has no MatMul with a constant weight of at least {recipe.block_size}")
        out[name] = _ort.int4_quantize(src, chosen, recipe.block_size, True, recipe.accuracy_level, recipe.bits)
        if name == BACKBONE:
            out[name] = files.with_weights(out[name])  # a skeleton's float weights, read for saving
        quantized += chosen
        kept += [q.name for q in nodes if q.name not in set(chosen)]
    return Built(out, f"int{recipe.bits}-weights", float_nodes=kept, quantized_nodes=quantized,
                 details={"bits": recipe.bits, "block_size": recipe.block_size, "accuracy_level": recipe.accuracy_level})


@builds(Fp16Recipe)
def build_fp16(ctx: Context, recipe: Fp16Recipe) -> Built:
    out = {}
    for name in recipe.targets:
        src = ctx.unet if name == BACKBONE else ctx.components[name]
        out[name] = _ort.fp16_convert(src, recipe.op_block_list)
    return Built(out, "fp16")


# --- low-bit floats (TensorRT's formats) -------------------------------------------------------

def _keep16_details(plan) -> dict:
    return {**plan.details, "kept_16bit_nodes": len(plan.keep16)}


@builds(Fp8Recipe)
def build_fp8(ctx: Context, recipe: Fp8Recipe) -> Built:
    from .lowbit_graphs import fp8_graph
    from .lowbit_plan import measured_graph, plan_lowbit

    plan = plan_lowbit(ctx, recipe)
    model = fp8_graph(ctx.unet, plan.nodes, plan.ranges, recipe.opset, plan.keep16)
    # with 16-bit layers, quality is measured with their inputs rounded through float16 too
    simulation = measured_graph(ctx.unet, recipe, plan.nodes, plan.ranges, plan.keep16) if plan.keep16 else None
    return Built({BACKBONE: model}, "fp8", float_nodes=plan.kept + plan.keep16, quantized_nodes=plan.nodes,
                 simulation=simulation, details=_keep16_details(plan), simulated_on_cpu=True,
                 stored_as=f"QDQ FLOAT8E4M3FN, opset {recipe.opset}" + (", 16-bit layers with float16 weights" if plan.keep16 else "")
                 + " (TensorRT FP8; ONNX Runtime CPU runs it as float simulation)",
                 quality_measured_on="fp32 simulation: FP8 Q/DQ, 16-bit layers' inputs rounded to fp16" if plan.keep16 else None)


@builds(Nvfp4Recipe)
def build_nvfp4(ctx: Context, recipe: Nvfp4Recipe) -> Built:
    from .lowbit_graphs import nvfp4_graph
    from .lowbit_plan import measured_graph, plan_lowbit

    plan = plan_lowbit(ctx, recipe)
    model = nvfp4_graph(ctx.unet, plan.nodes, recipe.activations, plan.ranges, recipe.form, plan.keep16)
    simulation = None
    if recipe.activations != "fp4":
        simulation = measured_graph(ctx.unet, recipe, plan.nodes, plan.ranges, plan.keep16)
    form = "Model Optimizer's TensorRT pattern (trt ops)" if recipe.form == "tensorrt" else "portable opset-23 Q/DQ"
    return Built({BACKBONE: model}, f"nvfp4-w4a{recipe.activations[2:]}", float_nodes=plan.kept + plan.keep16,
                 quantized_nodes=plan.nodes, simulation=simulation, cpu_runnable=False, details=_keep16_details(plan),
                 stored_as=f"NVFP4 ({form}); needs TensorRT (FLOAT4E2M1 has no ONNX Runtime CPU kernel)",
                 requires_provider="tensorrt",
                 quality_measured_on=("fp32 simulation: numpy-twin weights" + (", FP8 activation Q/DQ" if recipe.activations == "fp8"
                                      else ", activations rounded to fp16")) if simulation is not None else None)


def evaluate_sqnr(model, calib: CalibrationSet | None, threads: int) -> dict | None:
    """Backbone output SQNR vs fp32 per calibration step (recorded fp32 outputs); `model`: a ModelProto or an open
    session of it."""
    if calib is None or calib.outputs is None:
        return None
    steps = list(range(calib.num_steps))
    from .runner import backbone_outputs, sqnr_db

    got = backbone_outputs(model, calib, steps, threads)
    per_step = [sqnr_db(calib.outputs[s], got[j]) for j, s in enumerate(steps)]
    total = sqnr_db(calib.outputs, got)
    return {"mean_db": total, "per_step_db": [round(v, 2) if math.isfinite(v) else None for v in per_step],
            "timesteps": calib.timesteps.tolist(), "_outputs": got}
