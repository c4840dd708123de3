"""Behaviour baseline of `quantize`: sha256 of every file each recipe writes, on both embedded models.

    PYTHONPATH=src python bench/behaviour_hashes.py OUT.json [--only NAME,...] [--compare BASE.json]

Every recipe (and the main -O variants, --correct, --precision-schedule) runs with fixed, small
settings (4 calibration prompts x 4 steps, 1 thread) so a restructuring of quantize/ can be checked
to write the same bytes as before. Recorded per case: each ONNX file's sha256 (and its external
data's), the manifest with the entries that name a path or a time removed, and the report's
quality numbers (computed on ORT's CPU provider, 1 thread: deterministic here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"sd": ROOT / "models" / "shapes-sd-onnx", "mmdit": ROOT / "models" / "shapes-mmdit-onnx"}

# name, recipe, -O options, extra QuantizeConfig fields; the models each runs on (default both)
CASES = [
    ("fp16", "fp16", {}, {}),
    ("fp16-all", "fp16", {"components": "unet,vae_decoder,text_encoder"}, {}),
    ("int8-dynamic", "int8-dynamic", {}, {}),
    ("int8-static", "int8-static", {}, {}),
    ("int8-static-qdq", "int8-static", {"stored": "qdq"}, {}),
    ("int8-static-entropy", "int8-static", {"calibrator": "entropy"}, {}),
    ("int8-static-percentile", "int8-static", {"calibrator": "percentile"}, {}),
    ("int8-static-mean", "int8-static", {"aggregation": "mean"}, {}),
    ("int8-static-groups", "int8-static", {"attention": "int8", "norms": "int8", "smooth_alpha": "0.5"}, {}),
    ("int8-static-float-groups", "int8-static", {"attention": "float", "softmax": "float", "norms": "float",
                                                 "modulation": "float"}, {}),
    ("int8-static-keep-sensitive", "int8-static", {"keep_sensitive": "0.2"}, {}),
    ("int8-static-bias", "int8-static", {"bias_correction": "1"}, {}),
    ("int8-static-components", "int8-static", {"components": "unet,vae_decoder,text_encoder"}, {}),
    ("int8-static-correct-trajectory", "int8-static", {}, {"correct": True}),
    ("int8-static-correct-output", "int8-static", {}, {"correct": True, "correct_method": "output"}),
    ("int8-static-schedule", "int8-static", {}, {"schedule": {"steps": 1, "prompts": 4}}),
    ("int8-static-schedule-fp16", "int8-static", {}, {"schedule": {"steps": 1, "prompts": 4, "precision": "fp16"}}),
    ("int8-naive", "int8-naive", {"samples": "8"}, {}),
    ("int8-timestep", "int8-timestep", {"groups": "2"}, {}),
    ("mixed", "mixed", {"target_psnr": "60", "probe_prompts": "2", "sensitivity_steps": "1", "op_types": "Conv,MatMul"}, {}),
    ("int4-weights", "int4-weights", {"block_size": "16"}, {}),
    ("int4-weights-keep-gemms", "int4-weights", {"block_size": "16", "gemms": "keep"}, {}),
    ("int4-weights-int8", "int4-weights", {"block_size": "16", "others": "int8"}, {}),
    ("int4-weights-ratio", "int4-weights", {"block_size": "16", "target_ratio": "1.2"}, {}),
    ("int4-weights-gptq", "int4-weights", {"block_size": "16", "algorithm": "gptq", "gptq_steps": "2"}, {}),
    ("fp8", "fp8", {"keep_16bit": "none"}, {}),
    ("fp8-auto", "fp8", {"probe_prompts": "2", "sensitivity_steps": "1", "target_psnr": "60"}, {}),
    ("nvfp4", "nvfp4", {"keep_16bit": "none"}, {}),
    ("nvfp4-fp16", "nvfp4", {"activations": "fp16", "keep_16bit": "none"}, {}),
    ("nvfp4-trt", "nvfp4", {"form": "tensorrt", "keep_16bit": "none"}, {}),
    ("nvfp4-trt-fp4", "nvfp4", {"form": "tensorrt", "activations": "fp4"}, {}),
    ("nvfp4-auto", "nvfp4", {"probe_prompts": "2", "sensitivity_steps": "1", "target_psnr": "60"}, {}),
]


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _strip(manifest: dict) -> dict:
    """The manifest without what names this machine's paths or a run's time."""
    m = json.loads(json.dumps(manifest))
    m["files"].pop("quantize_report.json", None)
    q = m.get("quantization") or {}
    (q.get("source") or {}).pop("folder", None)
    q.pop("tool_versions", None)
    return m


def _numbers(obj):
    """The report's quality numbers, rounded to 6 significant digits (what a JSON diff shows)."""
    if isinstance(obj, dict):
        return {k: _numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numbers(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    return obj


def run_case(model_key: str, case, scratch: Path) -> dict:
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class
    from onnxdiffusion.quantize.schedule import ScheduleConfig

    name, recipe, options, extra = case
    extra = dict(extra)
    if "schedule" in extra:
        extra["schedule"] = ScheduleConfig(**extra["schedule"])
    src = MODELS[model_key]
    manifest = json.loads((src / "manifest.json").read_text())
    rec = manifest.get("recommended") or {}
    cal = CalibrationConfig(count=4, steps=4, batch=4, sampler=rec.get("sampler", "ddim"),
                            guidance=rec.get("guidance", 4.0))
    if name.endswith("-components") and model_key == "mmdit":
        options = {**options, "components": "unet,vae_decoder,text_encoder,text_encoder_2"}
    if name == "fp16-all" and model_key == "mmdit":
        options = {**options, "components": "unet,vae_decoder,text_encoder"}
    config = QuantizeConfig(recipe=recipe_class(recipe).with_options(options), calibration=cal, latency_runs=1,
                            measure_memory=False, threads=1, **extra)
    out = scratch / f"{model_key}-{name}"
    t = time.time()
    report = quantize(src, out, config, overwrite=True)
    got = json.loads((out / "manifest.json").read_text())
    onnx_files = {rel: digest for rel, digest in sorted(got["files"].items())
                  if not rel.endswith((".json", ".txt")) and not rel.startswith(("tokenizer", "scheduler"))}
    # the manifest's own record is checked against the bytes, so the hashes above are the files'
    for rel, digest in onnx_files.items():
        assert sha(out / rel) == digest, rel
    # graphs, not storage: a component kept in float16 storage (relayout --storage fp16) is hashed as the
    # float32 graph every tool reads from it, byte for byte the file it was stored from
    onnx_files = {rel: graph_sha(out / rel) if rel.endswith(".onnx") else d for rel, d in onnx_files.items()}
    return {"files": onnx_files, "manifest_sha256": hashlib.sha256(json.dumps(_strip(got), sort_keys=True).encode()).hexdigest(),
            "quality": _numbers(report.get("quality") or {}), "float_node_count": report["float_node_count"],
            "quantized_node_count": report["quantized_node_count"], "seconds": round(time.time() - t, 1),
            "_manifest": _strip(got)}


def graph_sha(path: Path) -> str:
    import onnx

    from onnxdiffusion.onnxio import fp16_storage

    model = onnx.load(str(path), load_external_data=False)
    if not fp16_storage.is_stored(model):
        return sha(path)
    return hashlib.sha256(fp16_storage.expand(model).SerializeToString()).hexdigest()


def tool_versions() -> dict:
    import numpy
    import onnx
    import onnxruntime

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def compare(a: dict, b: dict) -> int:
    """Print each case's verdict (ONNX files, manifest, quality numbers) and a summary; returns the number
    of cases whose ONNX files differ. Cases only in the baseline are reported as not run."""
    files_same = manifest_same = differ = 0
    not_run = sorted(set(a["cases"]) - set(b["cases"]))
    for key in sorted(set(a["cases"]) & set(b["cases"])):
        x, y = a["cases"][key], b["cases"][key]
        if "error" in x or "error" in y:
            same = x.get("error") == y.get("error")
            print(f"{key}: {'same error' if same else 'ERROR DIFFERS'}: {x.get('error')} | {y.get('error')}")
            files_same += same
            differ += not same
            continue
        f = x["files"] == y["files"]
        m = x["manifest_sha256"] == y["manifest_sha256"]
        other = [k for k in ("quality", "float_node_count", "quantized_node_count") if x[k] != y[k]]
        files_same += f
        manifest_same += f and m
        differ += not f
        print(f"{key}: onnx files {'identical' if f else 'DIFFER'} ({len(x['files'])}), manifest "
              f"{'identical' if m else 'differs'}{', ' + ', '.join(other) + ' differ' if other else ''}")
    print(f"{files_same} of {files_same + differ} recipe x model cases write identical ONNX files "
          f"({manifest_same} identical manifests too); {len(not_run)} not run: {', '.join(not_run) or '-'}")
    return differ


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--only", default="")
    p.add_argument("--models", default="sd,mmdit")
    p.add_argument("--compare", type=Path)
    p.add_argument("--manifests", type=Path, help="where the stripped manifests go (default: the temp folder)")
    args = p.parse_args()
    if args.compare and not args.only and args.out.exists():
        return 1 if compare(json.loads(args.compare.read_text()), json.loads(args.out.read_text())) else 0
    only = set(filter(None, args.only.split(",")))
    result = json.loads(args.out.read_text()) if args.out.exists() else {"cases": {}}
    result["tool_versions"] = tool_versions()  # the bytes are these versions' (ORT's quantizer, onnx's saver)
    # the manifests themselves (to diff when a hash differs) stay out of the repository: ~0.5 MB
    mpath = args.manifests or Path(tempfile.gettempdir()) / f"{args.out.stem}.manifests.json"
    manifests = json.loads(mpath.read_text()) if mpath.exists() else {}
    with tempfile.TemporaryDirectory(prefix="behaviour-") as scratch:
        for model_key in args.models.split(","):
            for case in CASES:
                if only and case[0] not in only:
                    continue
                key = f"{model_key}/{case[0]}"
                try:
                    result["cases"][key] = run_case(model_key, case, Path(scratch))
                except Exception as e:  # noqa: BLE001 - a recipe that fails must fail the same way after
                    result["cases"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                c = result["cases"][key]
                print(f"{key}: {c.get('error') or str(c['seconds']) + 's'}", flush=True)
                if "_manifest" in c:
                    manifests[key] = c.pop("_manifest")
                args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
                mpath.write_text(json.dumps(manifests, indent=1, sort_keys=True) + "\n")
    if args.compare:
        return 1 if compare(json.loads(args.compare.read_text()), result) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
