"""How close a backbone step is to what this CPU can do: measured GEMM peaks, FLOPs, achieved fraction.

  peaks      fp32 GEMM through ONNX Runtime's MatMul and numpy's BLAS, int8 GEMM through ORT's
             MatMulInteger (u8 x s8 -> s32: the VNNI kernels where the CPU has them), at 1 thread
             and at all cores. Each is a square GEMM timed many times; the best run is the peak.
  flops      multiply-adds x 2 per backbone call, counted from the fp32 ONNX graph with ORT's symbolic
             shape inference at the bench's input shapes: Conv, ConvTranspose, MatMul, Gemm and the
             attention ops (MultiHeadAttention/Attention: QK^T and AV). Elementwise ops, norms and
             softmax are left out (they are bandwidth, not FLOPs), so the fraction is of GEMM work.
  achieved   FLOPs / (time of one backbone call) / peak of that precision at the same thread count.
  profile    ORT's own profiler over one call: time per operator type, top first.

Timing on a loaded machine: with 1 thread, CPU time of this process (user + system) is reported
beside wall time; it leaves out the time other processes held the core, so it is the steadier
number there. Peaks and steps are interleaved in one process so drift hits both alike.

    python -m onnxdiffusion.bench.roofline MODEL [QUANTIZED ...] --threads 1 --out roofline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxdiffusion.bench.machine import machine_facts, machine_line
from onnxdiffusion.folder.manifest import Component, Manifest, confined

GEMM_N = 1024  # M = N = K: big enough for the packed kernels' steady state, small enough to repeat
COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "MultiHeadAttention", "Attention", "FusedConv",
               "FusedMatMul", "QLinearConv", "QLinearMatMul", "MatMulInteger", "ConvInteger", "MatMulNBits")


# --- clocks ---------------------------------------------------------------------------------------------
def _cpu() -> float:
    return time.process_time()  # CLOCK_PROCESS_CPUTIME_ID: all threads, ns resolution (os.times ticks 10 ms)


def timed(fn, repeats: int) -> dict:
    """Wall and process-CPU seconds of `repeats` calls of fn (after one warm-up call)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), _cpu()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(_cpu() - c0)
    return {"wall_s": wall, "cpu_s": cpu, "wall_min_s": min(wall), "wall_median_s": statistics.median(wall),
            "cpu_median_s": statistics.median(cpu)}


# --- GEMM microbenchmarks ---------------------------------------------------------------------------------
def _gemm_model(kind: str, n: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if kind == "fp32":
        b = numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), "B")
        node = helper.make_node("MatMul", ["A", "B"], ["Y"])
        a_t, y_t = TensorProto.FLOAT, TensorProto.FLOAT
        inits = [b]
    else:  # u8 activations x s8 weights, as ORT's int8 backbones run them
        b = numpy_helper.from_array(rng.integers(-127, 128, (n, n), dtype=np.int8), "B")
        zp = numpy_helper.from_array(np.array(128, np.uint8), "a_zp")
        node = helper.make_node("MatMulInteger", ["A", "B", "a_zp"], ["Y"])
        a_t, y_t = TensorProto.UINT8, TensorProto.INT32
        inits = [b, zp]
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("A", a_t, [n, n])],
                              [helper.make_tensor_value_info("Y", y_t, [n, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _session(model, threads: int, profile: str | None = None, disabled: list[str] | None = None):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.log_severity_level = 3
    if profile:
        o.enable_profiling = True
        o.profile_file_prefix = profile
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), o,
                                providers=["CPUExecutionProvider"], disabled_optimizers=disabled or [])


def gemm_peaks(threads: int, n: int = GEMM_N, repeats: int = 20) -> dict:
    """GFLOP/s of an n^3 GEMM: ORT MatMul fp32, ORT MatMulInteger int8, numpy fp32 (its BLAS's own threads)."""
    flops = 2.0 * n ** 3
    rng = np.random.default_rng(1)
    out = {}
    a32 = rng.standard_normal((n, n), dtype=np.float32)
    a8 = rng.integers(0, 256, (n, n), dtype=np.uint8)
    for kind, feed in (("ort_fp32", a32), ("ort_int8", a8)):
        sess = _session(_gemm_model(kind[4:], n), threads)
        t = timed(lambda s=sess, f=feed: s.run(None, {"A": f}), repeats)
        out[kind] = _rates(t, flops, threads)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = timed(lambda: a32 @ b, repeats)
    out["numpy_fp32"] = _rates(t, flops, threads)
    try:
        out["numpy_blas"] = next(iter(np.show_config(mode="dicts")["Build Dependencies"]["blas"].get("name", "?")
                                      for _ in [0]))
    except Exception:  # noqa: BLE001 - informational only
        out["numpy_blas"] = None
    return out


def _rates(t: dict, flops: float, threads: int) -> dict:
    r = {"gflops_best": flops / t["wall_min_s"] / 1e9, "gflops_median": flops / t["wall_median_s"] / 1e9}
    if threads == 1 and t["cpu_median_s"] > 0:
        r["gflops_cpu_time"] = flops / min(t["cpu_s"]) / 1e9
    return r


# --- FLOPs from the graph ------------------------------------------------------------------------------------
def _dims(vi) -> list[int] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    d = [x.dim_value if x.HasField("dim_value") else None for x in t.shape.dim]
    return None if any(v is None or v <= 0 for v in d) else d


def count_flops(model_path: Path, input_shapes: dict[str, list[int]]) -> dict:
    """2 x multiply-adds per call of the graph's compute ops at the given input shapes, by op type."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    from onnx import helper
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(model_path), load_external_data=False)
    # weights kept outside the file become graph inputs of the same shape: shape inference needs their
    # shapes, never their values, and would otherwise try to read them from an unknown base folder
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    for t in external:
        model.graph.initializer.remove(t)
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    for inp in model.graph.input:
        if inp.name in input_shapes:
            shape = inp.type.tensor_type.shape
            for d, v in zip(shape.dim, input_shapes[inp.name]):
                d.Clear()
                d.dim_value = int(v)
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
    shapes = {vi.name: _dims(vi) for vi in list(inferred.graph.value_info) + list(inferred.graph.input)
              + list(inferred.graph.output)}
    for init in inferred.graph.initializer:
        shapes[init.name] = list(init.dims)
    by_op: dict[str, float] = {}
    unknown = 0
    for node in inferred.graph.node:
        if node.op_type not in COMPUTE_OPS:
            continue
        f = _node_flops(node, shapes)
        if f is None:
            unknown += 1
            continue
        by_op[node.op_type] = by_op.get(node.op_type, 0.0) + f
    return {"total": sum(by_op.values()), "by_op": by_op, "nodes_without_shapes": unknown,
            "input_shapes": input_shapes}


def _node_flops(node, shapes: dict) -> float | None:
    get = lambda i: shapes.get(node.input[i]) if len(node.input) > i and node.input[i] else None  # noqa: E731
    out = shapes.get(node.output[0])
    if node.op_type in ("Conv", "ConvInteger", "QLinearConv", "FusedConv"):
        w = get(3 if node.op_type == "QLinearConv" else 1)
        if w is None or out is None:
            return None
        return 2.0 * float(np.prod(out)) * float(np.prod(w[1:]))  # each output: Cin/group * kh * kw MACs
    if node.op_type == "ConvTranspose":
        x, w = get(0), get(1)
        return None if x is None or w is None else 2.0 * float(np.prod(x)) * float(np.prod(w[1:]))
    if node.op_type in ("MatMul", "MatMulInteger", "QLinearMatMul", "FusedMatMul", "Gemm"):
        a = get(0)
        if a is None or out is None:
            return None
        k = a[-1]
        if node.op_type == "Gemm" and any(at.name == "transA" and at.i for at in node.attribute):
            k = a[0]
        return 2.0 * float(np.prod(out)) * float(k)
    if node.op_type in ("MultiHeadAttention", "Attention"):
        q, k = get(0), get(1)
        if q is None or k is None or len(q) != 3:
            return None
        b, s, hidden = q
        skv = k[1] if len(k) == 3 else s
        return 2.0 * 2.0 * b * s * skv * hidden  # Q K^T and softmax(.) V
    return None


# --- one backbone call: timing and profile ---------------------------------------------------------------------
def backbone_feed(manifest: Manifest, batch: int, height: int, width: int, context_dim: int) -> dict:
    info = manifest.pipeline
    f = int(info.vae_scale_factor)
    rng = np.random.default_rng(0)
    return {"sample": rng.standard_normal((batch, int(info.latent_channels), height // f, width // f),
                                          dtype=np.float32),
            "timestep": np.full((batch,), 500.0, np.float32),
            "encoder_hidden_states": rng.standard_normal((batch, int(info.model_max_length), context_dim),
                                                         dtype=np.float32)}


def _backbone(manifest: Manifest) -> Component:
    from ..families import get_family

    return manifest.components[get_family(manifest.family).backbone]


def _disabled(manifest: Manifest) -> list[str]:
    return _backbone(manifest).disabled_optimizers or []


def profile_ops(session_path: Path, feed: dict, threads: int, disabled: list[str], prefix: str) -> dict:
    """ORT profile of one call (after a warm-up): summed kernel time per op type, largest first."""
    sess = _session(session_path, threads, profile=prefix, disabled=disabled)
    sess.run(None, feed)  # warm-up (first-run allocations); only the last run's events are summed
    sess.run(None, feed)
    path = Path(sess.end_profiling())
    events = json.loads(path.read_text())
    path.unlink(missing_ok=True)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    last = runs[-1] if runs else None
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if last is not None and not (last["ts"] <= e["ts"] <= last["ts"] + last["dur"]):
            continue
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e6
    total = sum(by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])
    return {"kernel_total_s": total, "run_s": (last["dur"] / 1e6) if last else None,
            "ops": [{"op": k, "s": v, "share": v / total if total else None} for k, v in top]}


def measure(folders: dict[str, Path], threads: int, height: int, width: int, batch: int = 2, repeats: int = 5,
            profile: bool = True, progress=print, gemm_n: int = GEMM_N, time_first: bool = True) -> dict:
    """Peaks, FLOPs and achieved fraction for each backbone, interleaved; profiles when asked.
    time_first False: the first (fp32) folder only gives the FLOP count (a full-size fp32 session is
    not loaded beside the quantized ones)."""
    from ..folder.artifacts import read_manifest

    base = next(iter(folders.values()))
    man0 = read_manifest(base)
    unet0 = confined(base, _backbone(man0).path, "backbone")
    import onnx

    graph_inputs = {i.name: i for i in onnx.load(str(unet0), load_external_data=False).graph.input}
    context_dim = graph_inputs["encoder_hidden_states"].type.tensor_type.shape.dim[2].dim_value
    feed = backbone_feed(man0, batch, height, width, context_dim)
    progress("roofline: counting FLOPs in the fp32 graph")
    flops = count_flops(unet0, {k: list(v.shape) for k, v in feed.items()})
    if not time_first:
        folders = dict(list(folders.items())[1:])
    sessions = {}
    for name, folder in folders.items():
        man = read_manifest(folder)
        path = confined(folder, _backbone(man).path, "backbone")
        progress(f"roofline: loading {name}")
        sessions[name] = (_session(path, threads, disabled=_disabled(man)), path, _disabled(man),
                          dict(man.quantization) if isinstance(man.quantization, Mapping) else man.quantization)
    steps: dict[str, list] = {n: [] for n in folders}
    cpu: dict[str, list] = {n: [] for n in folders}
    peaks_runs = []
    for r in range(repeats):
        progress(f"roofline: round {r + 1}/{repeats}")
        peaks_runs.append(gemm_peaks(threads, n=gemm_n, repeats=5))
        names = list(folders)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sess = sessions[name][0]
            if r == 0:
                sess.run(None, feed)
            w0, c0 = time.perf_counter(), _cpu()
            sess.run(None, feed)
            steps[name].append(time.perf_counter() - w0)
            cpu[name].append(_cpu() - c0)
    peaks = {k: max(p[k]["gflops_best"] for p in peaks_runs) for k in ("ort_fp32", "ort_int8", "numpy_fp32")}
    if threads == 1:
        for k in ("ort_fp32", "ort_int8", "numpy_fp32"):
            peaks[k + "_cpu_time"] = max(p[k].get("gflops_cpu_time", 0) for p in peaks_runs)
    rows = {}
    for name in folders:
        q = sessions[name][3]
        int8 = q is not None and "int8" in json.dumps(q) or (q is not None and "int4" in json.dumps(q))
        peak_key = "ort_int8" if int8 else "ort_fp32"
        wall = statistics.median(steps[name])
        row = {"precision_peak": peak_key, "step_wall_median_s": wall, "step_wall_min_s": min(steps[name]),
               "achieved_gflops": flops["total"] / min(steps[name]) / 1e9}
        row["fraction_of_peak"] = row["achieved_gflops"] / peaks[peak_key]
        if threads == 1:
            c = min(cpu[name])
            row["step_cpu_min_s"] = c
            row["fraction_of_peak_cpu_time"] = flops["total"] / c / 1e9 / peaks[peak_key + "_cpu_time"]
        rows[name] = row
    if profile:
        for name in list(sessions):
            _, path, disabled, q = sessions[name]
            sessions[name] = (None, path, disabled, q)  # free the timing session: the profiler loads its own
            progress(f"roofline: profiling {name}")
            rows[name]["profile"] = profile_ops(path, feed, threads, disabled, f"/tmp/ortprof-{os.getpid()}-{name}")
    return {"threads": threads, "batch": batch, "height": height, "width": width, "gemm_n": gemm_n,
            "peaks_gflops": peaks, "peak_runs": peaks_runs, "flops_per_call": flops, "variants": rows,
            "method": __doc__.split("\n\n")[1].strip()}


def to_markdown(res: dict) -> str:
    p = res["peaks_gflops"]
    lines = [f"### Roofline, {res['threads']} thread(s), backbone batch {res['batch']} at {res['height']}x{res['width']}",
             "", *([f"Machine: {machine_line(res['machine'])}.", ""] if res.get("machine") else []),
             f"Measured GEMM peak ({res['gemm_n']}^3, best of the runs): ORT MatMul fp32 {p['ort_fp32']:.1f} GFLOP/s, "
             f"ORT MatMulInteger int8 {p['ort_int8']:.1f} GOP/s, numpy fp32 {p['numpy_fp32']:.1f} GFLOP/s"
             + (f" (by CPU time: {p['ort_fp32_cpu_time']:.1f} / {p['ort_int8_cpu_time']:.1f} / "
                f"{p['numpy_fp32_cpu_time']:.1f})" if "ort_fp32_cpu_time" in p else "") + ".",
             f"FLOPs per backbone call (GEMM work, counted from the fp32 graph): "
             f"{res['flops_per_call']['total'] / 1e9:.1f} G ("
             + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in sorted(res['flops_per_call']['by_op'].items(),
                                                                    key=lambda kv: -kv[1])) + ").",
             "",
             "| variant | peak used | step (best, wall) | achieved | fraction of peak | by CPU time |",
             "|---|---|---:|---:|---:|---:|"]
    for name, r in res["variants"].items():
        lines.append(f"| {name} | {r['precision_peak']} | {r['step_wall_min_s']:.3f} s | {r['achieved_gflops']:.1f} G/s "
                     f"| {r['fraction_of_peak']:.0%} | "
                     + (f"{r['fraction_of_peak_cpu_time']:.0%} |" if "fraction_of_peak_cpu_time" in r else "- |"))
    for name, r in res["variants"].items():
        prof = r.get("profile")
        if not prof:
            continue
        lines += ["", f"Top operators by time, {name} (ORT profile of one call, {prof['kernel_total_s']:.2f} s of kernels):",
                  "", "| op | s | share |", "|---|---:|---:|"]
        for o in prof["ops"][:8]:
            lines.append(f"| {o['op']} | {o['s']:.3f} | {o['share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="the fp32 model folder first, then quantized folders")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="backbone batch (2: one image with guidance)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--flops-only-first", action="store_true",
                    help="the first (fp32) folder only for the FLOP count: neither timed nor profiled")
    ap.add_argument("--out", type=Path, required=True, help="JSON results; a .md beside it")
    args = ap.parse_args(argv)
    folders = {(f"{f.name}"): f for f in args.folders}
    res = measure(folders, args.threads, args.size, args.size, args.batch, args.repeats, not args.no_profile,
                  progress=lambda m: print(m, file=sys.stderr, flush=True), time_first=not args.flops_only_first)
    res["machine_loadavg"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    res["machine"] = machine_facts(peaks=res["peaks_gflops"])  # CPU model, ISA flags (AMX / VNNI), ORT version
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
