"""int8-static's `kernels` option: the CPU-fused backbone's convolutions lowered for this CPU's kernels.

The graph rewrite and the per-CPU rule live in onnxdiffusion.cpu.int8_lowering; this module only wires
them to a build: ORT sessions on the (possibly > 2 GB, skeleton) fused graph, a calibration feed, and
ORT's profiler for `kernels=auto` (each eligible QLinearConv timed in place, both kernels, real shapes).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from onnxdiffusion.cpu.int8_lowering import lower, plan_kernels


def _node_times(model: onnx.ModelProto, feed: dict, names: set[str], threads: int, calls: int = 3) -> dict[str, float]:
    """Median kernel time (s) of each named node over `calls` profiled runs (after a warm-up run)."""
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-prof-") as tmp:
        sess = _profiled(model, threads, Path(tmp))
        sess.run(None, feed)
        for _ in range(calls):
            sess.run(None, feed)
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
        os.remove(path)
    per: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            if node in names:
                per.setdefault(node, []).append(e["dur"] * 1e-6)
    # the first run is the warm-up (arena growth, first touches): dropped
    return {n: statistics.median(v[1:] if len(v) > 1 else v) for n, v in per.items()}


def _profiled(model, threads: int, folder: Path):
    from . import files
    from .runner import disabled_for, session_options

    opts = session_options(threads, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(folder / "prof")
    disabled = list(disabled_for(model))
    source = files.session_source(model, opts)
    if source is not None:
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    with files.as_file(model) as path:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def measure_both(feed: dict, threads: int):
    def measure(model: onnx.ModelProto, names: set[str]) -> dict[str, tuple[float, float]]:
        sym = _node_times(model, feed, names, threads)
        lowered = copy.deepcopy(model)  # a skeleton's weights stay in their files: the copy is small
        lower(lowered, names)
        gemm = _node_times(lowered, feed, names, threads)
        return {n: (sym[n], gemm[n]) for n in names if n in sym and n in gemm}

    return measure


def apply(ctx, kernels: str, model: onnx.ModelProto) -> dict:
    """Lower `model` (the CPU-fused backbone) in place for `kernels`; the record goes to the manifest."""
    measure = None
    if kernels == "auto":
        calib = ctx.get_calibration()
        feed = calib.feed(calib.num_steps // 2, slice(0, 2))  # one guided pair, mid-trajectory
        measure = measure_both(feed, ctx.threads)
    chosen, record = plan_kernels(kernels, model, measure)
    record.update(lower(model, chosen) if chosen else {"lowered": 0})
    ctx.log(f"int8 kernels ({kernels}): {record['lowered']} of {record['eligible']} convolutions on QGEMM "
            f"({record['by']}" + (f"; {record['sym_ms']} -> {record['gemm_ms']} ms" if "sym_ms" in record else "") + ")")
    return record
