"""The shipped ControlNet through the ONNX run time (issue 24, acceptance 2 and 3).

models/shapes-sd-onnx carries `controlnets/position` (`add-controlnet` of models/controlnets/shapes-sd-position).
On held-out scenes prompted WITHOUT position words (scenes.caption_without_position), condition
scenes.render_condition(scene), evaluate's per-prompt latents, DDIM 20, guidance 4, 1 thread:

  fp32 + net        position from the net: judge position / attribute / strict accuracy
  fp32, no net      the same prompts left to chance
  int8 + net        an int8-static UNet (quantized here with its default settings) with the same fp32 net:
                    PSNR vs fp32 + net (acceptance 3: mean >= 35 dB) and its judge numbers
  step time         CPU seconds per generation (20 steps) with and without the net, fp32 and int8,
                    interleaved prompt by prompt; medians and ratios

    PYTHONPATH=src python experiments/controlnet/measure_onnx.py --work /tmp/cn-onnx [--count 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = ROOT / "models" / "shapes-sd-onnx"
NET = "position"
KEYS = ("position_accuracy", "shape_accuracy", "colour_accuracy", "attribute_accuracy", "strict_accuracy")


def cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")),
                platform.processor() or "?")


def int8_folder(work: Path) -> Path:
    """models/shapes-sd-onnx quantized int8-static with its defaults, carrying the same fp32 net."""
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.export.controlnet import add_controlnet

    out = work / "shapes-sd-int8"
    if not (out / "manifest.json").exists():
        subprocess.run(["onnxdiffusion", "quantize", str(MODEL), str(out), "--recipe", "int8-static", "--threads", "1"],
                       check=True)
    if NET not in (read_manifest(out).get("controlnets") or {}):
        # the diffusers folder's weights are not tracked: `make controlnet-weights` writes them from the ONNX copy
        add_controlnet(out, ROOT / "models" / "controlnets" / "shapes-sd-position", NET)
    return out


def run_set(pipe, scenes, latents, with_net: bool):
    from onnxdiffusion.evaluate import scenes as S
    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    images, seconds = [], []
    for sc, lat in zip(scenes, latents):
        kw = {"controlnets": [ControlNetSpec(NET, S.render_condition(sc))]} if with_net else {}
        t0 = time.process_time()
        out = pipe(S.caption_without_position(sc), latents=lat, steps=20, sampler="ddim", guidance=4.0, **kw)
        seconds.append(time.process_time() - t0)
        images.append(out.images[0])
    return np.stack(images), seconds


def main() -> None:
    from onnxdiffusion.evaluate import scenes as S
    from onnxdiffusion.evaluate.judge import Judge, score_scenes, summarize
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.evaluate.run import item_latents
    from onnxdiffusion.runtime import Pipeline

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--psnr-count", type=int, default=32)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    scenes = S.scenes("heldout", args.count)
    fp32 = Pipeline.from_folder(MODEL, threads=1)
    int8 = Pipeline.from_folder(int8_folder(args.work), threads=1)
    shape = fp32.latent_shape_for(1)
    latents = [item_latents(shape[1:], [i]) for i in range(args.count)]
    judge = Judge.from_file(threads=1)
    sets, times = {}, {}
    # interleaved: each set runs over the prompts in turn, so load drifts hit all alike
    for name, pipe, net in (("fp32_net", fp32, True), ("fp32_none", fp32, False), ("int8_net", int8, True),
                            ("int8_none", int8, False)):
        sets[name], times[name] = run_set(pipe, scenes, latents, net)
        print(name, "done", flush=True)
    result = {"cpu": cpu(), "count": args.count, "steps": 20, "sampler": "ddim", "guidance": 4.0, "sets": {}}
    for name, images in sets.items():
        summary = summarize(score_scenes(scenes, judge.predict(images)))
        result["sets"][name] = {k: summary[k] for k in KEYS}
        result["sets"][name]["seconds_median"] = statistics.median(times[name])
    n = args.psnr_count
    p = [psnr(a, b) for a, b in zip(sets["int8_net"][:n], sets["fp32_net"][:n])]
    result["int8_net_vs_fp32_net_psnr"] = {"count": n, "mean": float(np.mean(p)), "min": float(np.min(p))}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    result["time_ratio"] = {"fp32 net/none": ratio("fp32_net", "fp32_none"), "int8 net/none": ratio("int8_net", "int8_none"),
                            "int8+net / fp32+net": ratio("int8_net", "fp32_net")}
    (HERE / "onnx_results.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = ["| set | position | shape | colour | attribute | strict | s / image (median) |", "|---|---|---|---|---|---|---|"]
    for name, m in result["sets"].items():
        rows.append(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in KEYS) + f" | {m['seconds_median']:.3f} |")
    pr = result["int8_net_vs_fp32_net_psnr"]
    md = [f"# The shipped ControlNet through ONNX Runtime ({args.count} held-out scenes, position-free prompts)", "",
          f"CPU: {result['cpu']}, 1 thread; DDIM 20, guidance 4, evaluate's latents; CPU time per image.", "", *rows, "",
          f"int8-static UNet + ControlNet vs fp32 + ControlNet, first {n} scenes: {pr['mean']:.1f} dB mean, {pr['min']:.1f} dB worst.",
          "", "Time ratios (median of per-prompt ratios): " + ", ".join(f"{k} {v:.2f}x" for k, v in result["time_ratio"].items()),
          "", "    PYTHONPATH=src python experiments/controlnet/measure_onnx.py --work WORK --count " f"{args.count}", ""]
    (HERE / "onnx_results.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
