"""Acceptance measurements for the fp8 and nvfp4 recipes (issue 13) on exported model folders.

    .venv/bin/python experiments/lowbit/lowbit_eval.py [--model models/shapes-sd-onnx --model models/shapes-mmdit-onnx] [--count 128]

For each model (default: both embedded models, the UNet and the MMDiT) and each recipe: `quantize`
into --work/<model>/<label> (calibrated on the scene world's calib split, seeds 10000+, with the model's
recommended sampler, steps and guidance: its own trajectories), check the stored backbone with
onnx.checker (full), then generate the held-out prompts (seed i for prompt i, the model's recommended
sampler/steps/guidance from its manifest) and report image PSNR vs fp32 (mean over images, and the worst
image) and the judge's accuracy. fp8's stored file runs on ONNX Runtime's CPU provider (as float
simulation: no FP8 kernels there); nvfp4's cannot (no FLOAT4E2M1 kernel), so its images come from the
fp32 simulation graph (numpy-twin weights + the FP8 activation Q/DQ, or activations rounded through
fp16), which computes what the stored portable graph computes (tests/quantize/test_lowbit.py).

Writes experiments/lowbit/lowbit.json (one entry per model; models not run this time keep their earlier
entry) and lowbit.md (both models side by side) and lowbit.png.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.folder.artifacts import read_manifest  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402
from onnxdiffusion.quantize.configs import MODELOPT_KEEP_FLOAT  # noqa: E402
from onnxdiffusion.quantize.calibration import capture, load_prompts, step_ranges  # noqa: E402
from onnxdiffusion.quantize.graphs import quantizable_nodes  # noqa: E402
from onnxdiffusion.quantize.lowbit_plan import measured_graph  # noqa: E402
from onnxdiffusion.quantize.recipes import prepare_unet  # noqa: E402
from onnxdiffusion.quantize.runner import session  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

MODELS = (ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx")

# label, recipe, options, acceptance target (dB), families it runs on (None: every model)
AUTO = " (default: auto 16-bit layers)"
RUNS = [
    ("fp8 (W8A8 E4M3)" + AUTO, "fp8", {}, 40.0, None),
    ("nvfp4 weights, 16-bit activations" + AUTO, "nvfp4", {"activations": "fp16"}, 30.0, None),
    ("nvfp4 weights, FP8 activations" + AUTO, "nvfp4", {"activations": "fp8"}, 27.0, None),
    ("fp8 (W8A8 E4M3), every layer quantized", "fp8", {"keep_16bit": "none"}, 40.0, None),
    ("nvfp4 weights, 16-bit activations, every layer quantized", "nvfp4", {"activations": "fp16", "keep_16bit": "none"}, 30.0, None),
    ("nvfp4 weights, FP8 activations, every layer quantized", "nvfp4", {"activations": "fp8", "keep_16bit": "none"}, 27.0, None),
    ("nvfp4 TensorRT form, dynamic FP4 activations", "nvfp4", {"activations": "fp4", "form": "tensorrt"}, None, None),
]
# labels of the first version (recipe version 1, before 16-bit layers existed: every layer quantized)
RENAMED = {"fp8 (W8A8 E4M3)": RUNS[3][0], "nvfp4 weights, 16-bit activations": RUNS[4][0],
           "nvfp4 weights, FP8 activations": RUNS[5][0]}
# The hand-picked lists measured before the automatic choice existed (experiments/lowbit/lowbit_sensitivity.py: the final
# proj_out and the feed-forward up-projections hold 52% of the MMDiT's fp8 error); kept for comparison.
MMDIT_KEEP = ("/model/proj_out/*", "*/ff/net.0/proj/*")
HAND = {"keep_16bit": "none"}
RUNS += [
    ("fp8 (W8A8 E4M3), proj_out 16-bit", "fp8", {**HAND, "keep_float": ",".join(MODELOPT_KEEP_FLOAT + MMDIT_KEEP[:1])}, 40.0,
     ("sd3",)),
    ("fp8 (W8A8 E4M3), proj_out + ff.net.0.proj 16-bit", "fp8", {**HAND, "keep_float": ",".join(MODELOPT_KEEP_FLOAT + MMDIT_KEEP)},
     40.0, ("sd3",)),
    ("fp8 (W8A8 E4M3), proj_out + ff.net.0.proj + ff.net.2 16-bit", "fp8",
     {**HAND, "keep_float": ",".join(MODELOPT_KEEP_FLOAT + MMDIT_KEEP + ("*/ff/net.2/*",))}, 40.0, ("sd3",)),
    # the same two roles hold 54% of NVFP4's weight error (experiments/lowbit/lowbit_sensitivity_nvfp4.md)
    ("nvfp4 weights, 16-bit activations, proj_out + ff.net.0.proj 16-bit", "nvfp4",
     {**HAND, "activations": "fp16", "keep_float": ",".join(MODELOPT_KEEP_FLOAT + MMDIT_KEEP)}, 30.0, ("sd3",)),
]
PLOTTED = [lb for lb, *_ in RUNS[:6]]


# What the measurements say where a target is missed (by family; shown under the table)
NOTES = {
    "sd3": [
        "Why every layer FP8 misses 40 dB on the MMDiT (experiments/lowbit/lowbit_sensitivity.py, experiments/lowbit/lowbit_sensitivity_fp8.md, "
        "on its own calibration trajectories): backbone output SQNR 24.5 dB with every GEMM W8A8, 28.8 dB weights "
        "alone, 26.7 dB activations alone; per-input-channel activation scales give 26.65 dB (no gain: no outlier "
        "channels, the largest channel is at most 3.9x the median); held-out activations exceed the calibrated range "
        "by at most 1.22x and 4x scale headroom changes nothing (48 pairs: 39.18 -> 38.90 dB, "
        "experiments/lowbit/lowbit_fp8_headroom.py). The error is E4M3's 3-bit mantissa spread over all 82 GEMMs of a 64-wide model; "
        "the median image is about 40 dB and a tail of drifting images (worst 19.9-22.8 dB) holds the mean down.",
        "The default (`keep_16bit=auto`): each linear quantized alone on 4 timesteps of the calibration trajectories, "
        "ranked by the output error it adds per weight byte; the smallest prefix of that ranking whose float16 copy "
        "brings the probe (the 32 calibration prompts, seeds 10000+, full sampling runs) to the target + 2 dB "
        "(`margin_db`), within half the weight bytes (`max_16bit`). fp8 keeps 21 of 82 linears (23.2% of the weight "
        "bytes; 2.21x smaller instead of 2.45x); nvfp4 with 16-bit activations 23 (21.3%; 2.76x instead of 3.35x); "
        "nvfp4 with FP8 activations 6 (5.5%; 3.09x instead of 3.25x: every layer quantized already passes 27 dB on "
        "the held-out pairs, 28.21, but its probe read 27.51 < 27 + 2, so the margin bought 1.3 dB there). "
        "Both beat the hand-picked lists below on size and quality (the whole feed-forward in fp8: 1.80x, 39.98 dB; "
        "proj_out + ff.net.0.proj in nvfp4: 2.60x, 30.03 dB). The margin is measured, not guessed: with none, the "
        "fp8 search stopped at 10 linears (9.0%, probe 41.68 dB) and the held-out mean was 39.59 dB; the probe "
        "reads high once layers are chosen on it (with no layer kept it read 38.19 vs 38.25 held-out). The kept "
        "layers' inputs are rounded through float16 in the measured graph (16-bit activations, as nvfp4's fp16 mode).",
    ],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def settings_of(manifest: dict) -> tuple[str, int, float]:
    """The model's recommended sampler / steps / guidance (what it was evaluated with), else DDIM 20 at 4.0."""
    rec = manifest.get("recommended") or {}
    return str(rec.get("sampler") or "ddim"), int(rec.get("steps") or 20), float(rec.get("guidance", 4.0))


def run_model(model: Path, work: Path, count: int, calib_count: int, runs: list) -> dict:
    manifest = read_manifest(model)
    backbone = get_family(manifest.get("family")).backbone
    sampler, steps, guidance = settings_of(manifest)
    options = EvaluateOptions(count=count, steps=steps, sampler=sampler, guidance=guidance, batch=32)
    scenes = heldout_scenes(options)
    judge = Judge.from_file(threads=1)
    calib_cfg = CalibrationConfig(count=calib_count, steps=steps, sampler=sampler, guidance=guidance)

    pipe = Pipeline.from_folder(model, threads=1)
    fp32_session = pipe.backbone
    log(f"{model.name}: fp32 reference, {len(scenes)} held-out prompts ({sampler} {steps}, guidance {guidance})")
    ref = generate_set(pipe, scenes, options, progress=False)
    fp32_eval = evaluate_images(ref, scenes, judge)
    fp32_backbone = prepare_unet(onnx.load(str(model / manifest["components"][backbone]["path"])))
    calib = None
    result = {"model": model.name, "family": manifest.get("family", "sd"), "backbone": backbone,
              "settings": {"count": len(scenes), "split": "heldout", "steps": steps, "sampler": sampler,
                           "guidance": guidance, "calibration": calib_cfg.to_dict()},
              "fp32": {k: fp32_eval[k] for k in ("strict_accuracy", "attribute_accuracy")}, "recipes": {}}
    for label, name, opts, target, families in runs:
        if families is not None and result["family"] not in families:
            continue
        out = work / model.name / "".join(c if c.isalnum() else "_" for c in label)
        log(f"{model.name} {label}: quantize")
        recipe = recipe_class(name).with_options(opts)
        cfg = QuantizeConfig(recipe=recipe, calibration=calib_cfg, threads=1, latency_runs=20, measure_memory=False)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = quantize(model, out, cfg, overwrite=True, log=log)
        stored = onnx.load(str(out / backbone / "model.onnx"))
        trt = recipe.to_dict().get("form") == "tensorrt"
        try:
            onnx.checker.check_model(stored, full_check=not trt)
            checker = "passes (full)" if not trt else "passes (trt ops are custom)"
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            checker = f"fails: {str(e).splitlines()[0][:200]}"
        size = report["sizes"]["unet"]  # recipes call the backbone "unet" whatever the family
        entry = {"recipe": recipe.to_dict(), "target_db": target, "checker": checker,
                 "backbone_bytes": size["bytes"], "backbone_size_ratio": size["ratio"],
                 "latency_ratio_cpu": report["latency_ratio"], "verdict": report["verdict"],
                 "quantized_nodes": report["quantized_node_count"], "float_nodes": report["float_node_count"],
                 "probe_psnr_db": report["quality"].get("probe_psnr_db")}
        keep = report["details"].get("keep_16bit") or {}
        keep16 = list(keep.get("nodes") or [])
        if keep16 or keep.get("mode") == "auto":
            entry["kept_16bit"] = {k: keep.get(k) for k in ("node_count", "weight_bytes_fraction", "target_psnr_db",
                                                            "target_reached_on_probe", "budget_fraction")}
            entry["kept_16bit"]["nodes"] = keep16
            entry["kept_16bit"]["probe_trace"] = keep.get("probe", {}).get("trace")
        if name == "fp8" and not keep16:
            pipe.backbone = Pipeline.from_folder(out, threads=1).backbone
            entry["images_from"] = "the stored FP8 QDQ file on ONNX Runtime's CPU provider (float simulation of FP8)"
        elif name == "fp8" or opts.get("activations") in ("fp16", "fp8"):
            if calib is None:
                prompts, _ = load_prompts(calib_cfg)
                pipe.backbone = fp32_session
                calib = capture(pipe, prompts, calib_cfg)
            names = [q.name for q in quantizable_nodes(fp32_backbone, recipe.op_types, recipe.keep_float)]
            by_name = {n.name: n for n in fp32_backbone.graph.node}
            ranges = {}
            if name == "fp8" or opts["activations"] == "fp8":
                tensors = list(dict.fromkeys(by_name[n].input[0] for n in names))
                ranges = step_ranges(fp32_backbone, tensors, calib, 1).aggregate(None, "max")
            sim = measured_graph(fp32_backbone, recipe, [n for n in names if n not in set(keep16)], ranges, keep16)
            pipe.backbone = session(sim, 1)
            acts = "FP8 activation Q/DQ" if name == "fp8" or opts["activations"] == "fp8" else "activations rounded through fp16"
            entry["images_from"] = (f"fp32 simulation graph ({'FP8' if name == 'fp8' else 'numpy-twin NVFP4'} weights, {acts}"
                                    + (", 16-bit layers: float16 weights, inputs rounded through fp16)" if keep16 else ")"))
        else:
            entry["images_from"] = None
            entry["note"] = "dynamic FP4 activations run only in TensorRT (TRT_FP4DynamicQuantize); not measured here"
            result["recipes"][label] = entry
            continue
        log(f"{model.name} {label}: generate")
        images = generate_set(pipe, scenes, options, progress=False)
        pipe.backbone = fp32_session
        per_image = [psnr(a, b) for a, b in zip(images, ref)]
        ev = evaluate_images(images, scenes, judge)
        entry.update({"psnr_db_mean": float(np.mean([p for p in per_image if math.isfinite(p)] or [math.inf])),
                      "psnr_db_min": float(np.min(per_image)),
                      "strict_accuracy": ev["strict_accuracy"], "attribute_accuracy": ev["attribute_accuracy"]})
        entry["meets_target"] = entry["psnr_db_mean"] >= target
        log(f"{model.name} {label}: PSNR {entry['psnr_db_mean']:.2f} dB (target {target}), "
            f"strict {entry['strict_accuracy']:.3f}")
        result["recipes"][label] = entry
    return result


def _load_previous(path: Path) -> dict:
    """{model name: result} of an earlier run (the single-model layout of the first version included)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if "models" in old:
        models = dict(old["models"])
        for r in models.values():  # first-version labels (every layer quantized) under their current names
            r["recipes"] = {RENAMED.get(lb, lb): e for lb, e in r["recipes"].items()}
        return models
    if "recipes" in old:  # first version: one model, backbone fields named unet_*
        for e in old["recipes"].values():
            for k in ("bytes", "size_ratio"):
                if f"unet_{k}" in e:
                    e[f"backbone_{k}"] = e.pop(f"unet_{k}")
        old.setdefault("family", "sd")
        old.setdefault("backbone", "unet")
        return {old["model"]: old}
    return {}


def _settings_line(r: dict) -> str:
    s = r["settings"]
    return (f"{r['model']} ({r['family']}, {r['backbone']}): {s['count']} held-out prompt-seed pairs, {s['sampler']} "
            f"{s['steps']} steps, guidance {s['guidance']}; calibration {s['calibration']['count']} calib-split prompts "
            f"(seeds {s['calibration']['seed']}+) with the same sampler/steps/guidance; fp32 strict accuracy "
            f"{r['fp32']['strict_accuracy']:.3f}")


def _kept_cell(e: dict) -> str:
    k = e.get("kept_16bit")
    if not k:
        return "-"
    return f"{k['node_count']} ({k['weight_bytes_fraction']:.1%})"


def write_markdown(models: dict, path: Path) -> None:
    names = list(models)
    labels = list(dict.fromkeys(label for r in models.values() for label in r["recipes"]))
    lines = ["# fp8 / nvfp4 on the embedded models (mean / worst-image PSNR vs fp32 images, same prompts and seeds)", ""]
    head = "| recipe | target (dB) | " + " | ".join(f"{n}: mean dB | min | strict | backbone smaller | 16-bit layers (weight bytes)"
                                                   for n in names) + " |"
    lines += [head, "|---|---|" + "---|---|---|---|---|" * len(names)]
    for label in labels:
        cells = []
        target = None
        for n in names:
            e = models[n]["recipes"].get(label)
            if e is None:
                cells += ["-"] * 5
                continue
            target = e.get("target_db") if target is None else target
            ok = "" if "meets_target" not in e else (" ✓" if e["meets_target"] else " ✗")
            cells += [f"{e['psnr_db_mean']:.2f}{ok}" if "psnr_db_mean" in e else "-",
                      f"{e['psnr_db_min']:.2f}" if "psnr_db_min" in e else "-",
                      f"{e['strict_accuracy']:.3f}" if "strict_accuracy" in e else "-",
                      f"{e['backbone_size_ratio']}x", _kept_cell(e)]
        lines.append(f"| {label} | {target or '-'} | " + " | ".join(cells) + " |")
    lines += ["", "Settings:", ""] + [f"- {_settings_line(models[n])}" for n in names]
    lines += ["", "| model | recipe | checker | quantized / float nodes | images from |", "|---|---|---|---|---|"]
    for n in names:
        for label, e in models[n]["recipes"].items():
            lines.append(f"| {n} | {label} | {e['checker']} | {e['quantized_nodes']} / {e['float_nodes']} | "
                         f"{e['images_from'] or e.get('note')} |")
    for n in names:
        for note in NOTES.get(models[n].get("family"), []):
            lines.append(f"\n{n}: {note}")
    lines.append("\n`(default: auto 16-bit layers)`: the recipes as shipped (version 2); the 16-bit column gives the linears "
                 "kept 16-bit and their share of the quantized linears' fp32 weight bytes. `every layer quantized`: "
                 "`-O keep_16bit=none` (the version-1 recipes). The hand-picked rows are `-O keep_16bit=none "
                 "keep_float=...`.")
    lines.append("\nONNX Runtime's CPU provider has no FP8 or FP4 kernels: no speed is claimed here. "
                 "Reproduce: `python experiments/lowbit/lowbit_eval.py` (both models; `--model FOLDER` for one).")
    path.write_text("\n".join(lines) + "\n")


def write_plot(models: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lb for lb in PLOTTED if any("psnr_db_mean" in r["recipes"].get(lb, {}) for r in models.values())]
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 1.5, 3.6), dpi=80)
    width = 0.8 / max(1, len(models))
    x = np.arange(len(labels))
    for i, (name, r) in enumerate(models.items()):
        mean = [r["recipes"].get(lb, {}).get("psnr_db_mean", np.nan) for lb in labels]
        worst = [r["recipes"].get(lb, {}).get("psnr_db_min", np.nan) for lb in labels]
        bars = ax.bar(x + (i - (len(models) - 1) / 2) * width, mean, width, label=f"{name} (mean)")
        ax.scatter(x + (i - (len(models) - 1) / 2) * width, worst, marker="v", color=bars.patches[0].get_facecolor(),
                   edgecolor="k", zorder=3, label=f"{name} (worst image)")
    targets = [dict((lb, t) for lb, _, _, t, _ in RUNS)[lb] for lb in labels]
    for j, t in enumerate(targets):
        if t is not None:
            ax.hlines(t, j - 0.45, j + 0.45, colors="k", linestyles="--", lw=1, label="target" if j == 0 else None)
    ax.set_xticks(x, [lb.replace(AUTO, ",\nauto 16-bit layers").replace(", ", ",\n") for lb in labels], fontsize=7)
    ax.set_ylabel("PSNR vs fp32 images (dB)")
    ax.set_title("fp8 / nvfp4 backbones on both embedded models", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    try:  # 256 colours: a small file in the repository
        from PIL import Image

        Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    except ImportError:
        pass
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append",
                    help="exported model folder (repeatable; default: both embedded models)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "lowbit")
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--calib-count", type=int, default=32)
    ap.add_argument("--only", action="append", help="run only these recipe labels (prefix match), e.g. fp8")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "lowbit.json")
    args = ap.parse_args(argv)
    runs = [r for r in RUNS if not args.only or any(r[0].startswith(o) for o in args.only)]
    models = _load_previous(args.out)
    for model in args.model or MODELS:
        result = run_model(Path(model), args.work, args.count, args.calib_count, runs)
        prev = models.get(result["model"])
        if prev is not None and args.only:  # recipes not run this time keep their earlier entry
            result["recipes"] = {**prev["recipes"], **result["recipes"]}
            result["recipes"] = {lb: result["recipes"][lb] for lb, *_ in RUNS if lb in result["recipes"]}
        models[result["model"]] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"models": models}, indent=2) + "\n")
    write_markdown(models, args.out.with_suffix(".md"))
    write_plot(models, args.out.with_suffix(".png"))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
