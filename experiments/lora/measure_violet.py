"""The shipped LoRA (models/loras/shapes-sd-violet.safetensors) judged with and without the adapter (issue 23, acc. 4).

Prompts: held-out scenes (compositions never trained on) that contain a purple object, captioned with the word
"violet" (which shapes-sd never saw) and, as a control, with "purple"; plus held-out scenes without purple, to see
what the adapter does to everything else. Run-time LoRA on the fp32 folder with insertion points (same 20-step DDIM,
guidance 4, per-prompt latents as `evaluate`), optionally on the int8-static backbone too.

    PYTHONPATH=src python experiments/lora/measure_violet.py WORK [--count 32] [--int8]

WORK holds the derived folders; violet.{json,md} and violet.png (with / without, first 8 prompts) land here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LORA = ROOT / "models" / "loras" / "shapes-sd-violet.safetensors"
sys.path.insert(0, str(HERE))


def scene_sets(count: int):
    from onnxdiffusion.evaluate import scenes as S

    def renamed(sc, word):
        words = [word if w == "purple" else w for w in sc.caption.split()]
        return S.Scene(sc.objects, sc.background, sc.background2, sc.split_vertical, sc.jitter, " ".join(words),
                       sc.size_in_caption)

    purple, other, seed = [], [], 0
    while len(purple) < count or len(other) < count:
        sc = S.sample_scene(seed, "heldout")
        (purple if any(o.colour == "purple" for o in sc.objects) else other).append(sc)
        seed += 1
    purple = purple[:count]
    return {"violet": [renamed(s, "violet") for s in purple], "purple": purple, "no purple": other[:count]}


def images(pipe, scenes, loras):
    from onnxdiffusion.evaluate.run import item_latents

    out = []
    for i in range(0, len(scenes), 8):
        chunk = scenes[i : i + 8]
        lat = item_latents(pipe.latent_shape_for(len(chunk))[1:], list(range(i, i + len(chunk))))
        out.append(pipe([s.caption for s in chunk], batch=len(chunk), steps=20, sampler="ddim", guidance=4.0,
                        latents=lat, loras=loras).images)
    return np.concatenate(out)


def judged(judge, scenes, imgs) -> dict:
    from onnxdiffusion.evaluate.judge import score_scenes, summarize

    s = summarize(score_scenes(scenes, judge.predict(imgs)))
    return {k: s[k] for k in ("strict_accuracy", "attribute_accuracy", "colour_accuracy", "shape_accuracy", "position_accuracy")}


def grid(rows: list[np.ndarray], path: Path) -> None:
    from PIL import Image

    g = np.concatenate([np.concatenate(list(r), axis=1) for r in rows], axis=0)
    Image.fromarray(g).resize((g.shape[1] * 2, g.shape[0] * 2), Image.Resampling.NEAREST).save(path, optimize=True)


def main() -> None:
    from measure import cpu

    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.evaluate.judge import Judge
    from onnxdiffusion.runtime import Pipeline

    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--int8", action="store_true", help="also on an int8-static backbone (quantized into WORK)")
    ap.add_argument("--lora", type=Path, default=LORA, help="another LoRA file (a training checkpoint); results not written")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folders = {"fp32": args.work / "fp32_points"}
    if not folders["fp32"].exists():
        add_points(ROOT / "models" / "shapes-sd-onnx", folders["fp32"])
    if args.int8:
        from onnxdiffusion.quantize import QuantizeConfig, quantize, recipe_class

        q = args.work / "int8"
        if not q.exists():
            quantize(ROOT / "models" / "shapes-sd-onnx", q, QuantizeConfig(recipe=recipe_class("int8-static")(),
                                                                           latency_runs=1, measure_memory=False))
        folders["int8"] = args.work / "int8_points"
        if not folders["int8"].exists():
            add_points(q, folders["int8"])
    judge = Judge.from_file()
    sets = scene_sets(args.count)
    result = {"cpu": cpu(), "lora": args.lora.resolve().relative_to(ROOT).as_posix() if args.lora == LORA else args.lora.name,
              "bytes": args.lora.stat().st_size,
              "count": args.count, "runs": {}}
    pictures = {}
    for base, folder in folders.items():
        pipe = Pipeline.from_folder(folder)
        for name, scenes in sets.items():
            for with_lora in (False, True):
                imgs = images(pipe, scenes, [(str(args.lora), 1.0)] if with_lora else None)
                key = f"{base} / {name} / {'with' if with_lora else 'without'} LoRA"
                result["runs"][key] = judged(judge, scenes, imgs)
                print(key, result["runs"][key]["strict_accuracy"], flush=True)
                pictures[key] = imgs
    if "int8" in folders:
        from onnxdiffusion.evaluate.metrics import psnr

        a, b = pictures["int8 / violet / with LoRA"], pictures["fp32 / violet / with LoRA"]
        result["int8_lora_vs_fp32_lora_psnr"] = float(np.mean([psnr(x, y) for x, y in zip(a, b)]))
    if args.lora != LORA:
        return
    grid([pictures["fp32 / violet / without LoRA"][:8], pictures["fp32 / violet / with LoRA"][:8]], HERE / "violet.png")
    result["prompts"] = [s.caption for s in sets["violet"][:8]]
    (HERE / "violet.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# The shipped LoRA `{result['lora']}` ({result['bytes'] / 1024:.0f} KiB)", "",
             f"CPU: {result['cpu']}. {args.count} held-out prompts per set, 20 DDIM steps, guidance 4, judge "
             "(models/judge).", "", "| backbone / prompts / adapter | strict accuracy | attribute accuracy | colour accuracy |",
             "|---|---|---|---|"]
    for key, r in result["runs"].items():
        lines.append(f"| {key} | {r['strict_accuracy']:.3f} | {r['attribute_accuracy']:.3f} | {r['colour_accuracy']:.3f} |")
    if "int8_lora_vs_fp32_lora_psnr" in result:
        lines += ["", f"int8-static + LoRA vs fp32 + LoRA (violet prompts): {result['int8_lora_vs_fp32_lora_psnr']:.2f} dB mean."]
    lines += ["", "violet.png: the first 8 violet prompts without (top) and with (bottom) the adapter:", ""]
    lines += [f"{i + 1}. {p}" for i, p in enumerate(result["prompts"])]
    (HERE / "violet.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
