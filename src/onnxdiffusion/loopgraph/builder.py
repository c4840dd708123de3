"""The sampler loop as ONNX: the host loop's graph twin (see ``tables`` for the contract).

Two forms over the same step body:
  loop      one ``Loop`` node; the step count is a run-time input; the backbone's weights are
            outer-scope initializers, stored once
  unrolled  N copies of the body in the main graph, all reading the same initializers

Graph inputs: latents (B,C,H,W), cond and uncond embeddings (B,S,D) (and, for a backbone with
more conditioning inputs, cond_<name> and uncond_<name> for each), the sampler table (N,10)
as built by ``build_table``, init_scale and guidance scalars, noise (K,B,C,H,W) where step i
reads noise[min(i, K-1)] (pass K=1 zeros for deterministic samplers), and, for ``loop``, steps.
Image inputs (img2img, inpainting), each with a default that leaves a text-to-image run unchanged:
``start`` (the first table row that runs: one graph serves every strength; step i reads row
start + i and noise[min(i, K-1)]), ``image_latents`` and ``image_scale`` (the state starts at
latents * init_scale + image_latents * image_scale: the sampler's add_noise, latents being the
noise), ``keep`` (1 where the picture is kept, latent layout) and ``blend`` (R, 2): after row j
x = keep * (blend[j, 0] * image_latents + blend[j, 1] * latents) + (1 - keep) * x. A backbone whose
sample has more channels than the latents (a 9-channel inpainting UNet) takes them from
``sample_extra`` (B, E, H, W), concatenated after the scaled latents every step.
Output: final latents. Guidance runs inside: one backbone call on [uncond; cond] (cond alone
for a guidance-distilled backbone). Packed-token backbones take latents (B,S,D) instead.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .backbone import (BACKBONE_IO, CONTEXT, Backbone, conditioning_inputs, latent_dims,  # noqa: F401
                             inline_backbone, load_backbone, load_component, rename_outer_refs, sample_channels)
from .correct import rescale
from .techniques import technique_prologues
from ..techniques.inpaint_graph import blend_step, image_defaults, image_inputs
from .state import GraphRequest, GraphState
from ..samplers.tables import COLUMNS
from ..techniques.loop_base import StepIO
from ..techniques.registry import ORDER

FORMS = ("loop", "unrolled")
GUIDANCE_MODES = ("cfg", "cfg_rescale", "none")

VAE_DECODER_IO = {"latents": "latent_sample", "out": "sample"}


class _Builder:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(self, op_type: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def ops(self, op_type: str, inputs: list[str], outs: list[str], **attrs) -> list[str]:
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], **attrs))
        return outs

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name


def cond_input_names(name: str) -> tuple[str, str]:
    """Graph inputs (cond, uncond) of one backbone conditioning input."""
    return ("cond", "uncond") if name == CONTEXT else (f"cond_{name}", f"uncond_{name}")


def _constants(b: _Builder) -> None:
    b.const("axes0", np.array([0], np.int64))
    b.const("one_i64", np.array(1, np.int64))
    b.const("zero_f", np.array(0.0, np.float32))
    b.const("slice0_start", np.array([0], np.int64))
    b.const("slice0_end", np.array([1], np.int64))
    for k, col in enumerate(COLUMNS):
        b.const(f"col_{col}", np.array(k, np.int64))


def _prologue(b: _Builder, conditioning: list[str], given: dict[str, str], guidance_mode: str = "cfg") -> GraphState:
    """Values computed once, before the loop: guided conditioning, batch sizes, starting state.

    `given`: conditioning already in [uncond; cond] form (the whole graph's text side); the
    rest come in as cond/uncond graph inputs (cond alone when guidance_mode is "none")."""
    ctx = {}
    for name in conditioning:
        if name in given:
            ctx[name] = given[name]
        elif guidance_mode == "none":
            ctx[name] = cond_input_names(name)[0]
        else:
            c, u = cond_input_names(name)
            ctx[name] = b.op("Concat", [u, c], "context" if name == CONTEXT else f"context_{name}", axis=0)
    ctx_shape = b.op("Shape", [ctx[conditioning[0]]], "context_shape")
    batch2 = b.op("Slice", [ctx_shape, "slice0_start", "slice0_end"], "batch2")
    noise_shape = b.op("Shape", ["noise"], "noise_shape")
    k = b.op("Slice", [noise_shape, "slice0_start", "slice0_end"], "noise_k_vec")
    k = b.op("Squeeze", [k, "axes0"], "noise_k")
    last_noise = b.op("Sub", [k, "one_i64"], "noise_last")
    noised = b.op("Mul", ["latents", "init_scale"], "x_noise_part")
    x0 = b.op("Add", [noised, b.op("Mul", ["image_latents", "image_scale"], "x_image_part")], "x_init")
    d0 = b.op("Mul", [x0, "zero_f"], "d_init")
    b.const("one_f", np.array(1.0, np.float32))
    b.const("blend_col0", np.array(0, np.int64))
    b.const("blend_col1", np.array(1, np.int64))
    inv_keep = b.op("Sub", ["one_f", "keep"], "inv_keep")
    blend_shape = b.op("Shape", ["blend"], "blend_shape")
    blend_rows = b.op("Squeeze", [b.op("Slice", [blend_shape, "slice0_start", "slice0_end"], "blend_rows_vec"),
                                  "axes0"], "blend_rows")
    if guidance_mode == "cfg_rescale":
        b.const("last_axis", np.array([-1], np.int64))
    return GraphState(context=ctx, batch2=batch2, noise_last=last_noise, x0=x0, d0=d0, mode=guidance_mode,
                      inv_keep=inv_keep, blend_last=b.op("Sub", [blend_rows, "one_i64"], "blend_last"))


def _step(b: _Builder, bb: Backbone, pre: GraphState, i: str, x: str, d_prev: str, tag: str) -> tuple[str, str]:
    """One sampler step: nodes appended to `b`; returns the names of the new x and D."""

    def n(hint: str) -> str:
        return f"{tag}{hint}"

    j = b.op("Add", [i, "start"], n("row_index"))  # img2img: the run starts at table row `start`
    row = b.op("Gather", ["table", j], n("row"), axis=0)
    c = {col: b.op("Gather", [row, f"col_{col}"], n(col), axis=0) for col in COLUMNS}
    x_in = b.op("Mul", [x, c["c_in"]], n("x_in"))
    if pre.extra:  # an inpainting backbone: mask + masked-image latents after the scaled latents
        x_in = b.op("Concat", [x_in, "sample_extra"], n("x_in_extra"), axis=pre.extra_axis)
    guided_batch = pre.mode != "none"
    doubled = b.op("Concat", [x_in, x_in], n("x_in2"), axis=0) if guided_batch else x_in
    t_vec = b.op("Expand", [c["t"], pre.batch2], n("t_vec"))
    # inline the backbone, its inputs/outputs bound to this step's tensors
    remap = {bb.io["sample"]: doubled, bb.io["timestep"]: t_vec,
             **{bb.io[f"cond:{k}"]: v for k, v in pre.context.items()}}
    step = StepIO(i, c["t"], tag, n, sample=doubled, timestep=t_vec, single_sample=x_in)
    for t in pre.techniques:  # ControlNets inlined beside the backbone, their residuals into it
        remap.update(t.backbone_inputs(b, pre, bb, step))
    # a technique may make the backbone call itself (step caching: first -> If(rest | carried) -> tail; a
    # precision schedule: an If on t picks the high-precision backbone or this one)
    out = next((o for t in pre.techniques if (o := t.call_backbone(b, bb, remap, step)) is not None), None)
    if out is None:
        out = inline_backbone(b.nodes, bb, remap, tag)
    if guided_batch:
        u, cnd = b.ops("Split", [out], [n("out_u"), n("out_c")], axis=0)
        diff = b.op("Sub", [cnd, u], n("cfg_diff"))
        guided = b.op("Add", [u, b.op("Mul", [diff, "guidance"], n("cfg_scaled"))], n("guided"))
        if pre.mode == "cfg_rescale":
            guided = rescale(b, guided, cnd, n)
    else:  # guidance-distilled: the scale went in as a backbone input
        guided = out
    for t in pre.techniques:  # output correction
        guided = t.after_guidance(b, guided, step)
    den = b.op("Add", [b.op("Mul", [x, c["p"]], n("px")), b.op("Mul", [guided, c["q"]], n("qout"))], n("denoised"))
    noise_idx = b.op("Min", [i, pre.noise_last], n("noise_idx"))
    noise_i = b.op("Gather", ["noise", noise_idx], n("noise_i"), axis=0)
    # clip(D, -r, r): only DDIM's clip_sample has k != 0; elsewhere r = k = 0 and the term is 0
    clipped = b.op("Clip", [den, b.op("Neg", [c["r"]], n("neg_r")), c["r"]], n("D_clipped"))
    terms = [
        b.op("Mul", [x, c["a"]], n("ax")),
        b.op("Mul", [den, c["c"]], n("cD")),
        b.op("Mul", [d_prev, c["d"]], n("dDprev")),
        b.op("Mul", [noise_i, c["e"]], n("eNoise")),
        b.op("Mul", [clipped, c["k"]], n("kClipD")),
    ]
    x_new = b.op("Sum", terms, n("x_next"))
    return blend_step(b, pre, j, x_new, n), den


def _graph_inputs(latent_dims: list, conditioning: list[onnx.ValueInfoProto], with_steps: bool,
                  given: set[str], id_inputs: list[onnx.ValueInfoProto],
                  guidance_mode: str = "cfg", extra_channels: int = 0) -> list[onnx.ValueInfoProto]:
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("latents", f, ["batch", *latent_dims])]
    ins += id_inputs
    for vi in conditioning:
        if vi.name in given:
            continue
        dims = [d.dim_value if d.dim_value else (d.dim_param or f"{vi.name}_{k}")
                for k, d in enumerate(vi.type.tensor_type.shape.dim)]
        dims[0] = "batch"
        dims = ["sequence" if d == "sequence_length" else d for d in dims]
        names = cond_input_names(vi.name)[:1] if guidance_mode == "none" else cond_input_names(vi.name)
        ins += [helper.make_tensor_value_info(n, vi.type.tensor_type.elem_type, dims) for n in names]
    ins += [
        helper.make_tensor_value_info("table", f, ["table_rows", len(COLUMNS)]),
        helper.make_tensor_value_info("init_scale", f, []),
        helper.make_tensor_value_info("guidance", f, []),
        helper.make_tensor_value_info("noise", f, ["noise_steps", "batch", *latent_dims]),
    ]
    if with_steps:
        ins.append(helper.make_tensor_value_info("steps", TensorProto.INT64, []))
    if extra_channels:
        dims = [extra_channels, *latent_dims[1:]] if len(latent_dims) == 3 else [*latent_dims[:-1], extra_channels]
        ins.append(helper.make_tensor_value_info("sample_extra", f, ["batch", *dims]))
    return ins + image_inputs(len(latent_dims))


def _loop(b: _Builder, bb: Backbone, pre: GraphState, carried: dict[str, list]) -> str:
    """The Loop node over one step (plus the techniques' carried state); its final x."""
    body = _Builder()
    x_new, den = _step(body, bb, pre, "iter", "x_carried", "d_carried", tag="")
    cond = "cond_in"
    for t in pre.techniques:  # adaptive stopping: the cond output is its test
        if (ended := t.end_of_step(body, "iter", x_new, den, "d_carried")) is not None:
            cond, x_new = ended
    body.op("Identity", [cond], "cond_out")
    body.op("Identity", [x_new], "x_out")
    body.op("Identity", [den], "d_out")
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        body.nodes,
        "sampler_step",
        [
            helper.make_tensor_value_info("iter", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_carried", f, None),
            helper.make_tensor_value_info("d_carried", f, None),
            *carried["body_in"],
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", f, None),
            helper.make_tensor_value_info("d_out", f, None),
            *carried["body_out"],
        ],
    )
    # an explicit true condition: same meaning as none, and onnx's reference Loop needs it
    b.const("loop_true", np.array(True))
    b.nodes.append(
        helper.make_node("Loop", ["steps", "loop_true", pre.x0, pre.d0, *carried["loop_in"]],
                         ["latents_out", "denoised_out", *carried["loop_out"]], name="sampler_loop", body=graph)
    )
    return "latents_out"


def _sd_combine(ops, encoded: dict) -> dict:
    return {CONTEXT: encoded["text_encoder"]["last_hidden_state"]}


def build_sampling_graph(backbone: onnx.ModelProto, form: str = "loop", steps: int | None = None,
                         **options) -> onnx.ModelProto:
    """build(GraphRequest(backbone, form, steps, **options)): the options are GraphRequest's fields."""
    return build(GraphRequest(backbone, form, steps, **options))


def build(request: GraphRequest) -> onnx.ModelProto:
    """The whole N-step sampler (guidance, update, multistep state) as one ONNX model.

    With text encoders and `vae_decoder` the graph is the whole pipeline: token ids in
    (`input_ids`, `uncond_input_ids`, and `input_ids_2`, ... for further encoders), a uint8 NHWC
    `image` out. `text_encoders` maps component name -> (model, outputs read) and `combine` is
    the family's `combine(ops, encoded)`; `text_encoder` alone is the one-CLIP (SD) case.
    `guidance_mode`: "cfg" ([uncond; cond] batch, u + g (c - u)), "cfg_rescale" (then rescaled to
    the conditional output's norm over the last axis) or "none" (cond only: a guidance-distilled
    backbone takes the scale as one of its conditioning inputs). The latents take the backbone
    sample's layout (NCHW, or packed tokens [B, S, D]); a whole graph over packed tokens unpacks
    `latent_patch` x `latent_patch` patches for the VAE on int64 inputs grid_rows and grid_cols.
    `techniques`: the per-step techniques' Loop twins (techniques/loop_base.LoopTechnique: ControlNets, step
    caching, output correction, a precision schedule, adaptive stopping), called in the registry's order; what
    cannot combine is refused from techniques/registry.py's table.
    """
    from .whole import decoder_tokens, image_epilogue, text_prologue, unpack_patches

    r = request
    backbone, form, steps, latent_channels, text_encoders, combine = (r.backbone, r.form, r.steps, r.latent_channels,
                                                                       r.text_encoders, r.combine)
    vae_decoder, guidance_mode, latent_patch = r.vae_decoder, r.guidance_mode, r.latent_patch
    techniques = sorted(r.techniques, key=lambda t: ORDER.index(t.name))
    if form not in FORMS:
        raise ValueError(f"unknown loop form {form!r}; choose from {', '.join(FORMS)}")
    if guidance_mode not in GUIDANCE_MODES:
        raise ValueError(f"unknown guidance mode {guidance_mode!r}; choose from {', '.join(GUIDANCE_MODES)}")
    if form == "unrolled" and (steps is None or steps < 1):
        raise ValueError("the unrolled form needs steps >= 1")
    if r.text_encoder is not None:
        text_encoders = {"text_encoder": (r.text_encoder, ("last_hidden_state",))}
        combine = combine or _sd_combine
    whole = bool(text_encoders) or vae_decoder is not None
    if whole and (not text_encoders or vae_decoder is None or combine is None):
        raise ValueError("the whole-pipeline graph needs the text encoders, their combine and the VAE decoder")
    bb = load_backbone(backbone)
    dims = latent_dims(backbone, latent_channels)
    residuals = [name for t in techniques for name in t.residual_inputs()]  # fed by a technique (ControlNet)
    conditioning = [c for c in conditioning_inputs(backbone) if c.name not in residuals]
    if CONTEXT not in [c.name for c in conditioning]:
        raise ValueError(f"the backbone has no {CONTEXT} input")
    # the context first: its batch is the guided batch
    conditioning.sort(key=lambda vi: vi.name != CONTEXT)
    b = _Builder()
    _constants(b)
    extra_inits: list[onnx.TensorProto] = []
    functions = list(bb.functions)
    given: dict[str, str] = {}
    id_inputs: list[onnx.ValueInfoProto] = []
    if whole:
        given, inits, funcs, id_inputs = text_prologue(b, text_encoders, combine, load_component,
                                                       guided=guidance_mode != "none", text_outputs=r.text_outputs)
        if len(dims) == 2:
            if not latent_patch:
                raise ValueError("a whole graph over packed latent tokens needs latent_patch")
            id_inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in ("grid_rows", "grid_cols")]
        extra_inits += inits
        functions += funcs
    pre = _prologue(b, [c.name for c in conditioning], given, guidance_mode)
    channels, width = sample_channels(backbone), (latent_channels if len(dims) == 3 else dims[-1])
    extra_channels = channels - width if channels and isinstance(width, int) else 0
    if extra_channels < 0:
        raise ValueError(f"the backbone's sample has fewer channels than the latents ({width})")
    pre.extra, pre.extra_axis = extra_channels > 0, (1 if len(dims) == 3 else 2)
    image_defaults(b, len(dims))
    inits, funcs = technique_prologues(b, pre, bb, form, whole, techniques)
    extra_inits += inits
    functions += funcs
    parts = [t.carried() for t in techniques]
    carried = {k: [v for p in parts for v in getattr(p, k)] for k in ("body_in", "loop_in", "graph_out")}
    # a Loop's body gives its carried state first, then its scan outputs
    carried["body_out"] = [v for p in parts for v in p.body_out] + [v for p in parts for v in p.scan_body]
    carried["loop_out"] = [v for p in parts for v in p.loop_out] + [v for p in parts for v in p.scan_out]
    if form == "loop":
        final = _loop(b, bb, pre, carried)
    else:
        x, d = pre.x0, pre.d0
        for k in range(steps):
            i = b.const(f"step_{k}", np.array(k, np.int64))
            x, d = _step(b, bb, pre, i, x, d, tag=f"s{k}/")
        final = x
    # a technique's weights standing in for the backbone's (step caching: the first and tail pieces'; a
    # precision schedule: both backbones', or none outside its If branches)
    stand_in = next((w for t in techniques if (w := t.backbone_initializers()) is not None), None)
    f = TensorProto.FLOAT
    if whole:
        vae = load_component(vae_decoder, VAE_DECODER_IO, "vae_decoder/")
        if len(dims) == 2:
            final = decoder_tokens(b, final, r.decode)
            final = unpack_patches(b, final, int(dims[1]) // (latent_patch * latent_patch), latent_patch)
        if r.decode is None:
            image_epilogue(b, vae, final, 1.0 / r.vae_scaling_factor, r.vae_shift_factor)
        else:
            image_epilogue(b, vae, final, r.decode.scale, r.decode.shift, r.decode)
        extra_inits += vae.initializers
        functions += vae.functions
        outputs = [helper.make_tensor_value_info("image", TensorProto.UINT8, ["batch", "image_height", "image_width", 3])]
    else:
        b.op("Identity", [final], "final_latents")
        outputs = [helper.make_tensor_value_info("final_latents", f, ["batch", *dims])]
    outputs += carried["graph_out"]
    graph = helper.make_graph(
        b.nodes,
        f"sampler_{form}" + ("_whole" if whole else ""),
        _graph_inputs(dims, conditioning, form == "loop", set(given), id_inputs, guidance_mode, extra_channels)
        + [i for t in techniques for i in t.inputs()],
        outputs,
        initializer=b.inits + (stand_in if stand_in is not None else bb.initializers) + extra_inits,
    )
    models = [backbone, *(m for t in techniques for m in t.models()), vae_decoder,
              *(m for m, _ in (text_encoders or {}).values())]
    model = helper.make_model(graph, opset_imports=_merge_opsets(*models), producer_name="onnxdiffusion")
    model.ir_version = max(m.ir_version for m in models if m is not None)
    model.functions.extend(functions)
    return model


def _merge_opsets(*models: onnx.ModelProto | None) -> list[onnx.OperatorSetIdProto]:
    versions: dict[str, int] = {}
    for m in models:
        if m is None:
            continue
        for o in m.opset_import:
            versions[o.domain] = max(versions.get(o.domain, 0), o.version)
    return [helper.make_opsetid(d, v) for d, v in versions.items()]
