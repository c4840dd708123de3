"""Issue 44 acceptance 3: what the Hadamard rotation costs on a full-width Flux-like backbone, W4A8 vs W8A8.

The backbone is diffusers' FluxTransformer2DModel at FLUX.1's widths (3072 = 24 heads x 128, MLP 12288) with
one double-stream and one single-stream block (~520M parameters, random weights; the tiny text encoders give
a 32-wide context), exported with the tiny Flux pipeline of tests/ around it (experiments/single_file/flux_width.py).
Each variant is quantized (`--no-quality`: random weights), then every backbone is timed on one thread,
interleaved, at IMG image tokens (a 256x256 Flux image) + TXT text tokens, batch 1 (guidance-distilled);
ORT's profiler gives the rotation nodes' share of a rotated call (the "%" of acceptance 3). The speed gate's
verdict is quantize's own (its report, at the folder's default size).

    PYTHONPATH=src python experiments/rotation/fullwidth_speed.py WORK [--runs 7]   (~10 GB peak, resumable)

Writes experiments/rotation/fullwidth_speed.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "helpers"), str(ROOT / "experiments" / "single_file")]

IMG, TXT = 256, 64
# label -> (recipe, -O options); "every linear": modulation linears int8 too, nothing kept float; the other op
# groups forced float (their measured choice, `auto`, quantizes a 2 GB backbone five more times: > 13 GB here)
FLOAT_GROUPS = {"modulation": "int8", "attention": "float", "softmax": "float", "norms": "float"}
VARIANTS = {
    "w8a8": ("int8-static", FLOAT_GROUPS),
    "w8a8-rot": ("int8-static", {**FLOAT_GROUPS, "rotate": "hadamard"}),
    "w4a8": ("int4-weights", {"accuracy_level": "4"}),
    "w4a8-rot": ("w4a8", {}),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(work: Path) -> Path:
    from flux_width import real_width
    from tiny_families import build_tiny_flux

    from onnxdiffusion.export import ExportOptions, export_pipeline

    onnx_dir = work / "onnx"
    if (onnx_dir / "manifest.json").exists():
        return onnx_dir
    tiny = work / "tiny" / "flux"
    if not (tiny / "model_index.json").exists():
        build_tiny_flux(work / "tiny")
    wide = work / "wide"
    if not (wide / "model_index.json").exists():
        real_width(tiny, wide)
    log("export")
    options = ExportOptions(components=("text_encoder", "text_encoder_2", "transformer", "vae_decoder"), default_size=32)
    export_pipeline(wide, onnx_dir, options, progress=False)
    return onnx_dir


def feed_for(folder: Path) -> dict[str, np.ndarray]:
    import onnx

    graph = onnx.load(str(folder / "transformer" / "model.onnx"), load_external_data=False).graph
    rng = np.random.default_rng(0)
    feed = {}
    for t in graph.input:
        shape = []
        for d in t.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif d.dim_param == "batch_size":
                shape.append(1)
            elif "txt" in t.name or "encoder" in t.name:
                shape.append(TXT)
            else:
                shape.append(IMG)
        if t.name in ("timestep", "guidance"):
            feed[t.name] = np.full(shape, 0.5 if t.name == "timestep" else 3.5, np.float32)
        elif t.name.endswith("_ids"):
            feed[t.name] = rng.integers(0, 16, shape).astype(np.float32)
        else:
            feed[t.name] = rng.standard_normal(shape, dtype=np.float32)
    return feed


def rotation_share(path: Path, feed: dict, runs: int = 3) -> dict:
    """Share of op time the rotation nodes (Shape/Reshape/MatMul named */hadamard*) take, ORT's profiler."""
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.enable_profiling = True
    o.profile_file_prefix = str(path.parent / "profile")
    s = ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])
    s.run(None, feed)  # warm-up (its events are dropped below)
    for _ in range(runs):
        s.run(None, feed)
    events = json.loads(Path(s.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(nodes) // (runs + 1)
    nodes = nodes[per_run:]
    total = sum(e["dur"] for e in nodes)
    rot = sum(e["dur"] for e in nodes if "/hadamard" in e["name"])
    return {"rotation_us_per_call": rot / runs, "all_nodes_us_per_call": total / runs,
            "rotation_share_pct": 100.0 * rot / total if total else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "fullwidth_speed.json")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="labels to quantize and time (default: all)")
    args = ap.parse_args(argv)
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class
    from onnxdiffusion.quantize.runner import latency

    folder = build(args.work)
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update({"backbone": "FluxTransformer2DModel, widths of FLUX.1 (3072, 24x128 heads, MLP 12288), 1 double + "
                               "1 single block, random weights, context 32-wide (tiny encoders)",
                   "tokens": {"image": IMG, "text": TXT, "batch": 1}, "threads": 1,
                   "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()})
    result.setdefault("variants", {})
    files = {"fp32": folder / "transformer" / "model.onnx"}
    chosen = args.variants.split(",")
    for label, (name, opts) in VARIANTS.items():
        if label not in chosen:
            continue
        out = args.work / label
        if not (out / "quantize_report.json").exists():
            log(f"quantize {label}")
            cfg = QuantizeConfig(recipe=recipe_class(name).with_options(opts), threads=1, latency_runs=5,
                                 calibration=CalibrationConfig(count=4, steps=4, sampler="flow_euler", guidance=3.5))
            quantize(folder, out, cfg, overwrite=True, measure_quality=False, log=log)
        report = json.loads((out / "quantize_report.json").read_text())
        files[label] = out / "transformer" / "model.onnx"
        # rotation_share's profiler output lands beside the model: not the backbone's bytes
        size = sum(f.stat().st_size for f in (out / "transformer").iterdir() if f.is_file() and not f.name.startswith("profile"))
        result["variants"][label] = {"recipe": report["recipe"], "verdict": report["verdict"],
                                     "backbone_bytes": size, "size_ratio": report["sizes"].get("transformer", {}).get("ratio"),
                                     "quantize_latency": report["latency"].get("transformer"),
                                     "rotation": report["details"].get("rotation")}
    feed = feed_for(folder)
    log(f"timing {len(files)} backbones, {args.runs} interleaved runs each")
    t = latency(files, feed, 1, args.runs, warmup=1)
    fp32_ms = t["fp32"]["median_ms"]
    result["step_ms"] = {k: round(v["median_ms"], 1) for k, v in t.items()}
    result["vs_fp32"] = {k: round(v["median_ms"] / fp32_ms, 3) for k, v in t.items()}
    # a resumed run times only its --variants (and fp32): earlier runs' timings are kept beside, never mixed in
    result.setdefault("timings", []).append({"step_ms": result["step_ms"], "vs_fp32": result["vs_fp32"], "runs": args.runs,
                                             "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    for label in [v for v in ("w8a8-rot", "w4a8-rot") if v in files]:
        base = label[:-4]
        share = rotation_share(files[label], feed)
        result["variants"][label]["profile"] = share
        if base in t:
            result["variants"][label]["vs_unrotated"] = round(t[label]["median_ms"] / t[base]["median_ms"], 3)
    if "w8a8-rot" not in files or "w4a8-rot" not in files:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    w8, w4 = result["variants"]["w8a8-rot"], result["variants"]["w4a8-rot"]
    result["w4a8_vs_w8a8"] = {"step_time": round(t["w4a8-rot"]["median_ms"] / t["w8a8-rot"]["median_ms"], 3),
                              "bytes": round(w4["backbone_bytes"] / w8["backbone_bytes"], 3)}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
