"""The quantize report: sizes, measured latency against fp32 (the speed gate), quality, fused ops."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx

from ..folder.manifest import Manifest, confined
from .graphs import op_counts

REPORT_NAME = "quantize_report.json"
# "pays" means at least 5% faster than fp32: closer than that is within run-to-run noise
SPEEDUP_THRESHOLD = 0.95
INTEGER_OPS = ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearConcat", "QLinearSigmoid",
               "QLinearMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "ConvInteger", "MatMulInteger",
               "MatMulNBits", "DynamicQuantizeLinear")


def component_feed(name: str, manifest: Manifest, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """One call's inputs at the model's default size (the backbone gets the guided batch 2*batch),
    shaped from the component's I/O recorded in the manifest."""
    from ..families import get_family

    info = manifest.pipeline
    family = get_family(manifest.family)
    rng = np.random.default_rng(seed)
    f = info.vae_scale_factor
    dims = {"batch_size": batch if name.startswith("vae") else 2 * batch,
            "height_latent": info.default_height // f, "width_latent": info.default_width // f,
            "height": info.default_height, "width": info.default_width,
            "sequence_length": family.sequence_length(name, info)}
    special = family.timing_feed(name, info, dims["batch_size"], rng)
    if special is not None:
        return special
    feed = {}
    for t in manifest.components[name].inputs:
        shape = tuple(dims.get(d, 1) if isinstance(d, str) else d for d in t.shape)
        if t.dtype.startswith("int"):
            feed[t.name] = rng.integers(0, 20, shape).astype(t.dtype)
        elif t.name == "timestep":
            feed[t.name] = np.full(shape, 500.0, np.float32)
        elif name == "vae_encoder":
            feed[t.name] = rng.uniform(-1, 1, shape).astype(np.float32)
        else:
            feed[t.name] = rng.standard_normal(shape, dtype=np.float32)
    return feed


def measure_latency(model: Path, manifest: Manifest, components: dict[str, onnx.ModelProto], config) -> dict:
    from .runner import latency

    out = {}
    for name, new in components.items():
        feed = component_feed(name, manifest)
        src = confined(model, manifest.components[name].path, f"component '{name}'")
        t = latency({"fp32": src, "new": new}, feed, config.threads, config.latency_runs, config.provider)
        out[name] = {
            "fp32_median_ms": round(t["fp32"]["median_ms"], 3),
            "median_ms": round(t["new"]["median_ms"], 3),
            "ratio": round(t["new"]["median_ms"] / t["fp32"]["median_ms"], 3),
            "runs": config.latency_runs,
            "feed": {k: list(v.shape) for k, v in feed.items()},
        }
    return out


def fused_summary(model: onnx.ModelProto, threads: int = 1) -> dict:
    """What ONNX Runtime's CPU provider turns the graph into: integer kernels vs leftover Q/DQ."""
    from .runner import ort_optimized

    counts = op_counts(ort_optimized(model, threads, skeleton=True))
    return {
        "integer_ops": {k: counts[k] for k in INTEGER_OPS if counts.get(k)},
        "quantize_linear": counts.get("QuantizeLinear", 0),
        "dequantize_linear": counts.get("DequantizeLinear", 0),
        "float_conv": counts.get("Conv", 0) + counts.get("FusedConv", 0),
        "float_matmul": counts.get("MatMul", 0) + counts.get("FusedMatMul", 0) + counts.get("Gemm", 0),
    }


def _fmt(v, spec: str, none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def format_table(report: dict) -> str:
    lines = [f"recipe {report['recipe']['name']} -> {report['output']}  ({report['precision']}, provider {report['provider']}, "
             f"{report['threads']} thread{'s' if report['threads'] != 1 else ''})"]
    lines.append(f"{'component':13s} {'fp32 MB':>9s} {'new MB':>9s} {'smaller':>8s} {'fp32 ms':>9s} {'new ms':>9s} {'ratio':>7s}")
    for name, s in report["sizes"].items():
        lat = report["latency"].get(name, {})
        lines.append(f"{name:13s} {s['fp32_bytes'] / 1e6:9.2f} {s['bytes'] / 1e6:9.2f} {s['ratio']:7.2f}x "
                     f"{_fmt(lat.get('fp32_median_ms'), '9.2f'):>9s} {_fmt(lat.get('median_ms'), '9.2f'):>9s} "
                     f"{_fmt(lat.get('ratio'), '6.2f'):>6s}x")
    q = report.get("quality") or {}
    if q:
        sq = (q.get("backbone_sqnr_db") or {}).get("mean_db")
        parts = [f"backbone SQNR {_fmt(sq, '.1f')} dB", f"probe image PSNR {_fmt(q.get('probe_psnr_db'), '.1f')} dB"]
        if "probe_psnr_corrected_db" in q:
            parts.append(f"corrected: SQNR {_fmt(q.get('backbone_sqnr_corrected_db'), '.1f')} dB, "
                         f"PSNR {_fmt(q.get('probe_psnr_corrected_db'), '.1f')} dB")
        if "backbone_error_affine_fraction" in q:
            parts.append(f"affine part of the backbone error {100 * q['backbone_error_affine_fraction']:.0f}%")
        if q.get("measured_on"):
            parts.append(f"measured on the {q['measured_on']}")
        lines.append("quality vs fp32 (calibration prompts): " + ", ".join(parts))
    lines.append(f"float nodes kept: {report['float_node_count']}  quantized: {report['quantized_node_count']}")
    fused = report.get("fused_ops")
    if fused:
        ops = ", ".join(f"{k} {v}" for k, v in fused["integer_ops"].items()) or "none"
        lines.append(f"ORT CPU fused: {ops}; Q/DQ left {fused['quantize_linear']}/{fused['dequantize_linear']}; "
                     f"float Conv {fused['float_conv']}, float MatMul {fused['float_matmul']}")
    mem = report.get("memory") or {}
    if mem.get("fp32") and mem.get("new"):
        lines.append(f"backbone resident memory: {mem['new']['after_run_mb']:.1f} MB vs fp32 {mem['fp32']['after_run_mb']:.1f} MB")
    ps = report.get("precision_schedule")
    if ps:
        ch = ps.get("chosen")
        lines.append("precision schedule: " + ("none stored (no step set closed any error)" if not ch else
                     f"{ps['config']['precision']} at steps {ch['high_steps']} of {ps['calibration']['steps']} "
                     f"{ps['calibration']['sampler']}: closes {100 * ch['closed']:.0f}% of the quantized image MSE on "
                     f"calibration prompts (target {100 * ps['config']['target']:.0f}%"
                     f"{'' if ch['target_reached'] else ', NOT reached'}), est. backbone time "
                     f"{ch['estimated_backbone_ratio']:.2f}x the quantized one's"))
    ratio = report.get("latency_ratio")
    lines.append(f"speed: {report['verdict']}" + (f" (backbone latency {ratio:.2f}x fp32)" if ratio is not None else ""))
    return "\n".join(lines)
