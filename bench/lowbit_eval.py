"""Acceptance measurements for the fp8 and nvfp4 recipes (issue 13) on an exported model folder.

    .venv/bin/python bench/lowbit_eval.py [--model models/shapes-sd-onnx] [--count 128]

For each recipe: `quantize` into --work/<label> (calibrated on the scene world's calib split, seeds
10000+), check the stored backbone with onnx.checker (full), then generate the held-out prompts
(seed i for prompt i, DDIM 20 steps, the model card's guidance) and report image PSNR vs fp32
(mean over images) and the judge's accuracy. fp8's stored file runs on ONNX Runtime's CPU provider
(as float simulation: no FP8 kernels there); nvfp4's cannot (no FLOAT4E2M1 kernel), so its images
come from the fp32 simulation graph (numpy-twin weights + the FP8 activation Q/DQ, or activations
rounded through fp16), which computes what the stored portable graph computes (tests/test_lowbit.py).
Writes bench/results/lowbit.json and lowbit.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402
from onnxdiffusion.quantize.calibration import capture, load_prompts, step_ranges  # noqa: E402
from onnxdiffusion.quantize.graphs import quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.lowbit_graphs import simulation_graph  # noqa: E402
from onnxdiffusion.quantize.recipes import prepare_unet  # noqa: E402
from onnxdiffusion.quantize.runner import session  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

# label, recipe, options, acceptance target (dB)
RUNS = [
    ("fp8 (W8A8 E4M3)", "fp8", {}, 40.0),
    ("nvfp4 weights, 16-bit activations", "nvfp4", {"activations": "fp16"}, 30.0),
    ("nvfp4 weights, FP8 activations", "nvfp4", {"activations": "fp8"}, 27.0),
    ("nvfp4 TensorRT form, dynamic FP4 activations", "nvfp4", {"activations": "fp4", "form": "tensorrt"}, None),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "shapes-sd-onnx")
    ap.add_argument("--card", type=Path, default=ROOT / "models" / "shapes-sd" / "eval.json",
                    help="the model card whose evaluated guidance is used")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "lowbit")
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--calib-count", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lowbit.json")
    args = ap.parse_args(argv)
    try:
        guidance = float(json.loads(args.card.read_text())["options"]["guidance"])
    except (OSError, KeyError, ValueError, TypeError):
        guidance = 4.0
    args.work.mkdir(parents=True, exist_ok=True)
    options = EvaluateOptions(count=args.count, steps=20, sampler="ddim", guidance=guidance, batch=32)
    scenes = heldout_scenes(options)
    judge = Judge.from_file(threads=1)
    calib_cfg = CalibrationConfig(count=args.calib_count, steps=20, sampler="ddim", guidance=guidance)

    pipe = Pipeline.from_folder(args.model, threads=1)
    fp32_session = pipe.backbone
    log(f"fp32 reference: {len(scenes)} held-out prompts")
    ref = generate_set(pipe, scenes, options, progress=False)
    fp32_eval = evaluate_images(ref, scenes, judge)
    manifest = json.loads((args.model / "manifest.json").read_text())
    fp32_unet = prepare_unet(onnx.load(str(args.model / manifest["components"]["unet"]["path"])))
    calib = None
    result = {"model": args.model.name, "settings": {"count": len(scenes), "split": "heldout", "steps": 20,
                                                     "sampler": "ddim", "guidance": guidance,
                                                     "calibration": calib_cfg.to_dict()},
              "fp32": {k: fp32_eval[k] for k in ("strict_accuracy", "attribute_accuracy")}, "recipes": {}}
    for label, name, opts, target in RUNS:
        out = args.work / label.split(" ")[0] / "_".join(f"{k}-{v}" for k, v in opts.items()) if opts else args.work / name
        log(f"{label}: quantize")
        recipe = recipe_class(name).with_options(opts)
        cfg = QuantizeConfig(recipe=recipe, calibration=calib_cfg, threads=1, latency_runs=20, measure_memory=False)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = quantize(args.model, out, cfg, overwrite=True, log=log)
        stored = onnx.load(str(out / "unet" / "model.onnx"))
        try:
            onnx.checker.check_model(stored, full_check=recipe.to_dict().get("form") != "tensorrt")
            checker = "passes (full)" if recipe.to_dict().get("form") != "tensorrt" else "passes (trt ops are custom)"
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            checker = f"fails: {str(e).splitlines()[0][:200]}"
        entry = {"recipe": recipe.to_dict(), "target_db": target, "checker": checker,
                 "unet_bytes": report["sizes"]["unet"]["bytes"], "unet_size_ratio": report["sizes"]["unet"]["ratio"],
                 "latency_ratio_cpu": report["latency_ratio"], "verdict": report["verdict"],
                 "quantized_nodes": report["quantized_node_count"], "float_nodes": report["float_node_count"],
                 "probe_psnr_db": report["quality"].get("probe_psnr_db")}
        if name == "fp8":
            pipe.backbone = Pipeline.from_folder(out, threads=1).backbone
            entry["images_from"] = "the stored FP8 QDQ file on ONNX Runtime's CPU provider (float simulation of FP8)"
        elif opts.get("activations") in ("fp16", "fp8"):
            if calib is None:
                prompts, _ = load_prompts(calib_cfg)
                pipe.backbone = fp32_session
                calib = capture(pipe, prompts, calib_cfg)
            names = [q.name for q in quantizable_nodes(fp32_unet, recipe.op_types, recipe.keep_float)]
            by_name = {n.name: n for n in fp32_unet.graph.node}
            ranges = {}
            if opts["activations"] == "fp8":
                tensors = list(dict.fromkeys(by_name[n].input[0] for n in names))
                ranges = step_ranges(fp32_unet, tensors, calib, 1).aggregate(None, "max")
            sim = simulation_graph(fp32_unet, names, "nvfp4", opts["activations"], ranges)
            pipe.backbone = session(sim, 1)
            entry["images_from"] = "fp32 simulation graph (numpy-twin NVFP4 weights" + (
                ", FP8 activation Q/DQ)" if opts["activations"] == "fp8" else ", activations rounded through fp16)")
        else:
            entry["images_from"] = None
            entry["note"] = "dynamic FP4 activations run only in TensorRT (TRT_FP4DynamicQuantize); not measured here"
            result["recipes"][label] = entry
            continue
        log(f"{label}: generate")
        images = generate_set(pipe, scenes, options, progress=False)
        pipe.backbone = fp32_session
        per_image = [psnr(a, b) for a, b in zip(images, ref)]
        ev = evaluate_images(images, scenes, judge)
        entry.update({"psnr_db_mean": float(np.mean([p for p in per_image if math.isfinite(p)] or [math.inf])),
                      "psnr_db_min": float(np.min(per_image)),
                      "strict_accuracy": ev["strict_accuracy"], "attribute_accuracy": ev["attribute_accuracy"]})
        entry["meets_target"] = entry["psnr_db_mean"] >= target
        log(f"{label}: PSNR {entry['psnr_db_mean']:.2f} dB (target {target}), strict {entry['strict_accuracy']:.3f}")
        result["recipes"][label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# fp8 / nvfp4 on {result['model']} ({len(scenes)} held-out prompt-seed pairs, DDIM 20, guidance {guidance})", "",
             "| recipe | mean PSNR vs fp32 (dB) | min | target | strict acc | unet smaller | checker | images from |",
             "|---|---|---|---|---|---|---|---|"]
    for label, e in result["recipes"].items():
        p = f"{e['psnr_db_mean']:.2f}" if "psnr_db_mean" in e else "-"
        mn = f"{e['psnr_db_min']:.2f}" if "psnr_db_min" in e else "-"
        acc = f"{e['strict_accuracy']:.3f}" if "strict_accuracy" in e else "-"
        lines.append(f"| {label} | {p} | {mn} | {e['target_db'] or '-'} | {acc} | {e['unet_size_ratio']}x | {e['checker']} | "
                     f"{e['images_from'] or e.get('note')} |")
    lines.append(f"\nfp32 strict accuracy {result['fp32']['strict_accuracy']:.3f}. "
                 "ONNX Runtime's CPU provider has no FP8 or FP4 kernels: no speed is claimed here.")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
