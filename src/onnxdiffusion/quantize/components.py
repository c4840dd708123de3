"""int8-static for the components around the backbone: the VAE decoder and the text encoders.

    int8-static -O components=unet,vae_decoder,text_encoder

Calibration comes from the same fp32 sampling runs as the backbone's: the VAE decoder sees the final
latents of the calibration trajectories (through the family's decoder feed: scaling, shift, unpacking),
each text encoder the calibration prompts' token ids and the empty negative prompt's. Ranges are min/max,
reduced in-graph (stats.py), one call per feed. Every Conv / MatMul / Gemm with a constant weight is
quantized (per-channel symmetric int8 weights, uint8 activations; MatMul and Gemm outputs left float,
as the backbone's), except the nodes `components_keep_float` names; normalizations, attention and
activations stay float. Stored as ONNX Runtime's CPU-fused graph like the backbone.
What it costs in image quality (final-image PSNR vs fp32 on held-out prompt-seed pairs) and gains in
speed is measured by bench/component_quant_eval.py and bench/sd15_component_quant.py (bench/report_sd15/README.md,
"VAE decoder, text encoder").
"""

from __future__ import annotations

import numpy as np
import onnx

from ..errors import UserError
from . import _ort
from .graphs import (activation_tensors, compact_names, fold_matmul_bias, prepare_unet, quantizable_nodes,
                     reroute_shape_reads)

OP_TYPES = ("Conv", "MatMul", "Gemm")


def calibration_feeds(pipe, name: str, calib, prompts: list[str]) -> list[dict[str, np.ndarray]]:
    """One feed per calibration sample for component `name`, from the fp32 calibration runs."""
    if name == "vae_decoder":
        if calib.latents is None:
            raise UserError("the VAE decoder is calibrated on the final latents of fp32 trajectories; this calibration has none")
        from ..runtime.generation import GenerateOptions

        h, w = pipe.image_size(GenerateOptions())
        final = calib.latents[-1]  # (prompts, ...): each trajectory's last state
        return [{"latent_sample": pipe.family.decoder_feed(pipe.info, final[i:i + 1], h, w)} for i in range(len(final))]
    if name not in pipe.tokenizers:
        raise UserError(f"int8-static cannot calibrate component {name!r}")
    tokenizer = pipe.tokenizers[name]
    return [{"input_ids": tokenizer([p])} for p in [*prompts, ""]]


def _ranges(model: onnx.ModelProto, tensors: list[str], feeds: list[dict], threads: int) -> dict[str, tuple[float, float]]:
    from .runner import session
    from .stats import collect_minmax, minmax_model

    aug, outs = minmax_model(model, tensors)
    sess = session(aug, threads, stats=True)
    lo, hi = collect_minmax(sess, outs, ((0, f) for f in feeds), 1)
    lo, hi = np.minimum(lo[0], 0.0), np.maximum(hi[0], 0.0)  # a range holds 0 exactly, as ORT's do
    return {t: (float(lo[i]), float(hi[i])) for i, t in enumerate(tensors)}


def output_snr_db(fp32: onnx.ModelProto, new: onnx.ModelProto, feeds: list[dict], threads: int) -> float:
    """Output SNR (dB) of `new` vs `fp32` over the feeds (all outputs, concatenated)."""
    from .runner import session, sqnr_db

    a, b = session(fp32, threads), session(new, threads)
    ref = np.concatenate([np.ravel(x) for f in feeds for x in a.run(None, f)])
    got = np.concatenate([np.ravel(x) for f in feeds for x in b.run(None, f)])
    return sqnr_db(ref, got)


# Int8 recipes run on the CPU provider only (configs.INT8_PROVIDERS), so by default a graph is stored as the graph
# that provider runs: Q/DQ pairs already fused into integer kernels, linear biases folded into them. Measured on the
# embedded model (1 thread, interleaved): 0.55x fp32 latency vs 0.59x for the same weights stored as QDQ and fused at
# load time.
CPU_STORED_AS = "ONNX Runtime CPU-fused graph (QLinearConv / MatMulIntegerToFloat with folded biases)"
QDQ_STORED_AS = "QDQ (portable: standard ONNX ops, attention written out; fused by the provider at load time)"


def stored_graph(model: onnx.ModelProto, stored: str, threads: int) -> tuple[onnx.ModelProto, str]:
    """A QDQ graph (compact names) as an int8 recipe stores it (backbone or component), and the manifest's words."""
    if stored == "qdq":  # standard ops only: OpenVINO / TensorRT cannot run ORT's fused attention (it splits
        # their graph around each one: 4x slower measured on OpenVINO's provider at SD1.5 size)
        from ..onnxio.attention import decompose_attention

        return decompose_attention(model), QDQ_STORED_AS
    from .runner import ort_optimized

    fused = ort_optimized(model, threads, skeleton=True)  # a streamed build's output stays a skeleton
    fold_matmul_bias(fused)
    return compact_names(fused), CPU_STORED_AS


def quantize_component(model: onnx.ModelProto, feeds: list[dict], keep_float: tuple[str, ...], threads: int,
                       stored: str = "cpu-fused") -> tuple[onnx.ModelProto, dict]:
    """`model` (fp32) with its weight linears int8-static; returns it and what was done."""
    work = prepare_unet(model)  # named nodes, shapes
    every = quantizable_nodes(work, OP_TYPES)
    nodes = [q.name for q in quantizable_nodes(work, OP_TYPES, keep_float)]
    if not nodes:
        raise UserError("no Conv / MatMul / Gemm with a constant weight left to quantize in this component")
    tensors = activation_tensors(work, nodes)
    ranges = _ranges(work, tensors, feeds, threads)
    q = _ort.qdq_quantize(work, ranges, nodes, OP_TYPES, "uint8", ("MatMul", "Gemm"))
    reroute_shape_reads(q)
    q, _ = stored_graph(compact_names(q), stored, threads)
    details = {"quantized_nodes": len(nodes), "float_nodes": sorted({n.name for n in every} - set(nodes)),
               "calibration_feeds": len(feeds), "output_snr_db": round(output_snr_db(model, q, feeds, threads), 2)}
    return q, details
