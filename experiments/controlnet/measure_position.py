"""The shipped ControlNet (models/controlnets/shapes-sd-position) judged with and without it (issue 24).

Held-out scenes (compositions never trained on), prompted WITHOUT position words
(scenes.caption_without_position); the condition is scenes.render_condition(scene). Three sets, all
with the same per-prompt latents (evaluate's item_latents), 20-step DDIM, guidance 4, torch float32
through diffusers (StableDiffusionControlNetPipeline / StableDiffusionPipeline on the same parts):

  with net        position-free prompt + condition      position must come from the net
  without net     position-free prompt, no condition    position is left to chance
  positioned      the usual positioned caption, no net  sanity: the base model's normal strict accuracy

"chance" is the position accuracy the same pictures would earn against places drawn at random from
the scene world's prior (chance_position), what an unguided placement earns by luck.

    PYTHONPATH=src python experiments/controlnet/measure_position.py [--count 64] [--threads 1]

results.json, results.md and grid.png (condition | without | with, first 12 scenes) land here.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = ROOT / "models" / "shapes-sd"
CONTROLNET = ROOT / "models" / "controlnets" / "shapes-sd-position"  # its weights: `make controlnet-weights` first
KEYS = ("position_accuracy", "shape_accuracy", "colour_accuracy", "size_accuracy", "attribute_accuracy",
        "strict_accuracy", "extra_object_rate")


def cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")),
                platform.processor() or "?")


def pipelines(model: Path, controlnet: Path):
    import torch
    from diffusers import (ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline,
                           StableDiffusionPipeline)

    plain = StableDiffusionPipeline.from_pretrained(model, torch_dtype=torch.float32, safety_checker=None,
                                                    requires_safety_checker=False)
    plain.scheduler = DDIMScheduler.from_pretrained(model / "scheduler")
    net = ControlNetModel.from_pretrained(controlnet, torch_dtype=torch.float32)
    parts = {k: v for k, v in plain.components.items() if k not in ("safety_checker", "feature_extractor",
                                                                     "image_encoder")}
    ctrl = StableDiffusionControlNetPipeline(**parts, controlnet=net, safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    for p in (plain, ctrl):
        p.set_progress_bar_config(disable=True)
    return plain, ctrl


def generate(pipe, prompts: list[str], conds: list[np.ndarray] | None, batch: int = 16) -> np.ndarray:
    import torch
    from PIL import Image

    from onnxdiffusion.evaluate.run import item_latents

    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        lat = torch.from_numpy(item_latents((4, 16, 16), list(range(i, i + len(chunk)))))
        kw = {"image": [Image.fromarray(c) for c in conds[i : i + batch]]} if conds is not None else {}
        with torch.no_grad():
            res = pipe(chunk, height=64, width=64, num_inference_steps=20, guidance_scale=4.0, latents=lat,
                       output_type="np", **kw)
        out.append(np.clip(np.round(res.images * 255), 0, 255).astype(np.uint8))
    return np.concatenate(out)


def judged(judge, scenes, imgs) -> dict:
    from onnxdiffusion.evaluate.judge import score_scenes, summarize

    s = summarize(score_scenes(scenes, judge.predict(imgs)))
    return {k: (round(s[k], 4) if s[k] is not None else None) for k in KEYS}


def chance_position(judge, scenes, imgs) -> float:
    """Position accuracy the pictures would earn if the prompts had asked for places drawn at random.

    The scene world's prior: one object in any of the five slots, two objects in left/right or
    top/bottom (either order), so each of them in one of those four slots.
    """
    from onnxdiffusion.evaluate import scenes as S

    occupied = judge.predict(imgs)["shape"] > 0
    pair_slots = [S.POSITION_NAMES.index(p) for p in ("left", "right", "top", "bottom")]
    hits = [occupied[i].mean() if len(sc.objects) == 1 else occupied[i][pair_slots].mean()
            for i, sc in enumerate(scenes) for _ in sc.objects]
    return round(float(np.mean(hits)), 4)


def grid(rows: list[np.ndarray], path: Path) -> None:
    from PIL import Image

    g = np.concatenate([np.concatenate(list(r), axis=1) for r in rows], axis=0)
    Image.fromarray(g).resize((g.shape[1] * 2, g.shape[0] * 2), Image.Resampling.NEAREST).save(path, optimize=True)


def table(res: dict) -> str:
    cols = ("position_accuracy", "shape_accuracy", "colour_accuracy", "attribute_accuracy", "strict_accuracy")
    lines = ["| set | prompt | " + " | ".join(c.replace("_accuracy", "") for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for name, prompt in (("with ControlNet", "no position words"), ("without", "no position words"),
                         ("positioned captions, no ControlNet", "usual caption")):
        r = res["sets"][name]
        lines.append(f"| {name} | {prompt} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    ch = res["chance_position"]
    lines += ["", f"Chance position accuracy (the same pictures scored against places drawn from the scene world's "
              f"prior): {ch['without']:.3f} without, {ch['with']:.3f} with the ControlNet."]
    return "\n".join(lines)


def main() -> None:
    import torch

    from onnxdiffusion.evaluate import scenes as S
    from onnxdiffusion.evaluate.judge import Judge

    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--controlnet", type=Path, default=CONTROLNET)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scenes = S.scenes("heldout", args.count)
    nopos = [S.caption_without_position(s) for s in scenes]
    conds = [S.render_condition(s) for s in scenes]
    plain, ctrl = pipelines(MODEL, args.controlnet)
    judge = Judge.from_file(threads=args.threads)
    t0 = time.time()
    imgs = {"with": generate(ctrl, nopos, conds), "without": generate(plain, nopos, None),
            "positioned": generate(plain, [s.caption for s in scenes], None)}
    sets = {"with ControlNet": judged(judge, scenes, imgs["with"]),
            "without": judged(judge, scenes, imgs["without"]),
            "positioned captions, no ControlNet": judged(judge, scenes, imgs["positioned"])}
    weights = args.controlnet / "diffusion_pytorch_model.safetensors"
    res = {"count": args.count, "split": "heldout", "steps": 20, "sampler": "ddim", "guidance": 4.0,
           "controlnet_bytes": weights.stat().st_size, "cpu": cpu(), "threads": args.threads,
           "seconds": round(time.time() - t0, 1), "sets": sets,
           "chance_position": {k: chance_position(judge, scenes, imgs[k]) for k in ("without", "with")},
           "prompts_first": nopos[:8]}
    (HERE / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    cmd = "PYTHONPATH=src HF_HUB_OFFLINE=1 python experiments/controlnet/measure_position.py " \
          f"--count {args.count} --threads {args.threads}"
    md = ["# ControlNet position control, shapes-sd (issue 24)", "",
          f"{args.count} held-out scenes, 20-step DDIM, guidance 4, torch float32 via diffusers, same latents in "
          "every set; judge: models/judge/judge.onnx. Condition: `scenes.render_condition` (silhouettes).", "",
          table(res), "", f"CPU: {res['cpu']}, {args.threads} thread(s), {res['seconds']} s for the three sets.",
          f"ControlNet weights: {res['controlnet_bytes']} bytes (float16).", "", f"Command: `{cmd}`", "",
          "grid.png: per scene, condition | without | with ControlNet (first 12 scenes)."]
    (HERE / "results.md").write_text("\n".join(md) + "\n")
    k = min(12, args.count) // 4 * 4  # four scenes (12 tiles) a row
    triples = [[conds[i], imgs["without"][i], imgs["with"][i]] for i in range(k)]
    grid([np.stack(sum(triples[r : r + 4], [])) for r in range(0, k, 4)], HERE / "grid.png")
    print(table(res))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
