"""The embedded models' image tasks, scored by the judge (issue 24, acceptance 2).

recolour  a rendered one-object scene (say a red circle on the left) and the prompt "a blue circle"
          (no position: the place must come from the picture), img2img at strength 0.8. Scored:
          the judge reads the asked colour and the source shape at the source's slot, nothing else.
          Baseline: the same prompt and seed without the picture (text-to-image).
inpaint   a one-object scene and a mask over the other slot of its layout (the half of the image
          holding it); the prompt is the two-object caption. Scored: the judge reads the asked
          object in the mask and the original one outside; PSNR of the pixels outside the mask vs
          the source picture (the VAE's round trip is all that may change them).

    PYTHONPATH=src python bench/image_tasks.py [--count 48] [--out bench/results/image_tasks]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from onnxdiffusion.evaluate import scenes as S
from onnxdiffusion.evaluate.judge import Judge, per_image, score
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

MODELS = {"shapes-sd": "models/shapes-sd-onnx", "shapes-mmdit": "models/shapes-mmdit-onnx"}
NOTE = "Reading: every training caption names a position, so `a blue circle` alone is outside what the embedded models were taught; from the picture they still recolour at the same place 0.41-0.56 of the time against 0.28-0.34 for the prompt alone (the issue's own red-circle case fails on both), and with the position phrase (`a blue circle on the left`) img2img recolours every case at the source's place with the shape kept (1.000 strict on 32). Colour/shape are scored at the source's slot, so they cannot exceed 'same place'."
PARTNER = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}


def _scene(objs, bg) -> S.Scene:
    return S.Scene(objects=tuple(objs), background=bg, jitter=tuple((0, 0) for _ in objs))


def recolour_cases(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cases = [(S.SceneObject("circle", "red", "left", "large"), "blue", S.BACKGROUNDS[0])]  # the example
    while len(cases) < count:
        o = S.SceneObject(S.SHAPES[rng.integers(5)], S.COLOUR_NAMES[rng.integers(6)], S.POSITION_NAMES[rng.integers(5)],
                          S.SIZE_NAMES[rng.integers(2)])
        new = S.COLOUR_NAMES[rng.integers(6)]
        if new != o.colour:
            cases.append((o, new, S.BACKGROUNDS[rng.integers(len(S.BACKGROUNDS))]))
    return cases


def _judge_one(judge, image, objects, size=False):
    pred = per_image(judge.predict(image[None]))[0]
    return score(objects, size, pred)


def recolour(pipe, judge, count: int, strength: float, kw: dict) -> dict:
    rows = []
    for i, (o, new, bg) in enumerate(recolour_cases(count)):
        src = S.render(_scene([o], bg))
        target = S.SceneObject(o.shape, new, o.position, o.size)
        prompt = f"a {new} {o.shape}"
        placed = S.caption_for((target,), np.random.default_rng(i), with_size=False)  # with its position phrase
        runs = {"img2img": pipe(prompt, image=src, strength=strength, seed=i, **kw),
                "text_only": pipe(prompt, seed=i, **kw),
                "img2img_positioned": pipe(placed, image=src, strength=strength, seed=i, **kw)}
        row = {"prompt": prompt, "positioned_prompt": placed, "source": f"{o.colour} {o.shape} {o.position}"}
        for kind, res in runs.items():
            r = _judge_one(judge, res.images[0], [target])
            row[kind] = {**{k: r["objects"][0][k] for k in ("colour", "shape", "position")}, "strict": r["strict"]}
        rows.append(row)

    def rate(kind, key):
        return float(np.mean([r[kind][key] for r in rows]))
    return {"count": len(rows), "strength": strength, "first_case": rows[0],
            **{f"{kind}_{key}": rate(kind, key) for kind in ("img2img", "text_only", "img2img_positioned")
               for key in ("colour", "shape", "position", "strict")}}


def half_mask(position: str) -> np.ndarray:
    """255 over the image half holding `position` (2 pixels short of the centre line), 0 elsewhere."""
    m = np.zeros((S.IMAGE_SIZE, S.IMAGE_SIZE), np.uint8)
    h = S.IMAGE_SIZE // 2
    sl = {"left": np.s_[:, :h - 2], "right": np.s_[:, h + 2:], "top": np.s_[:h - 2, :], "bottom": np.s_[h + 2:, :]}
    m[sl[position]] = 255
    return m


def inpaint(pipe, judge, count: int, kw: dict) -> dict:
    rng = np.random.default_rng(1)
    rows = []
    while len(rows) < count:
        pos = ("left", "right", "top", "bottom")[rng.integers(4)]
        a = S.SceneObject(S.SHAPES[rng.integers(5)], S.COLOUR_NAMES[rng.integers(6)], pos, S.SIZE_NAMES[rng.integers(2)])
        b = S.SceneObject(S.SHAPES[rng.integers(5)], S.COLOUR_NAMES[rng.integers(6)], PARTNER[pos], "large")
        if (a.shape, a.colour) == (b.shape, b.colour):
            continue
        bg = S.BACKGROUNDS[rng.integers(len(S.BACKGROUNDS))]
        src = S.render(_scene([a], bg))
        mask = half_mask(b.position)
        pair = (a, b) if a.position in ("left", "top") else (b, a)
        prompt = S.caption_for(pair, rng, with_size=False)
        res = pipe(prompt, image=src, mask=mask, strength=1.0, seed=len(rows), **kw)
        got = res.images[0]
        # the same latents, with the picture's own pixels pasted back outside the mask (mask_overlay)
        from onnxdiffusion.runtime.image_input import apply_overlay, overlay_alpha

        over = apply_overlay(res.images, (src, overlay_alpha(mask, *src.shape[:2], 0.0)))[0]
        r = _judge_one(judge, got, list(pair))
        asked = r["objects"][pair.index(b)]
        kept = r["objects"][pair.index(a)]
        outside = mask == 0
        rows.append({"prompt": prompt, "asked_in_mask": bool(asked["shape"] and asked["colour"]),
                     "kept_outside": bool(kept["shape"] and kept["colour"]), "strict": r["strict"],
                     "strict_overlay": _judge_one(judge, over, list(pair))["strict"],
                     "psnr_outside_db": psnr(got[outside], src[outside]),
                     "psnr_outside_overlay_db": psnr(over[outside], src[outside])})
    ps = [r["psnr_outside_db"] for r in rows]
    return {"count": len(rows), "asked_in_mask": float(np.mean([r["asked_in_mask"] for r in rows])),
            "kept_outside": float(np.mean([r["kept_outside"] for r in rows])),
            "strict": float(np.mean([r["strict"] for r in rows])),
            "strict_overlay": float(np.mean([r["strict_overlay"] for r in rows])),
            "psnr_outside_mean_db": float(np.mean(ps)), "psnr_outside_min_db": float(np.min(ps)),
            "psnr_outside_overlay_min_db": float(np.min([r["psnr_outside_overlay_db"] for r in rows])),
            "first_case": rows[0]}


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        flags = next(l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
        return f"{name} ({' '.join(isa)})"
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--strength", type=float, default=0.8)
    ap.add_argument("--out", type=Path, default=Path("bench/results/image_tasks"))
    args = ap.parse_args()
    judge = Judge.from_file()
    results = {"cpu": _cpu(), "models": {}}
    for name, folder in MODELS.items():
        t = time.perf_counter()
        pipe = Pipeline.from_folder(folder)
        kw = {}  # the folder's recommended sampler, steps, guidance
        results["models"][name] = {"recolour": recolour(pipe, judge, args.count, args.strength, kw),
                                   "inpaint": inpaint(pipe, judge, args.count, kw),
                                   "settings": pipe.recommended, "seconds": round(time.perf_counter() - t, 1)}
        print(name, json.dumps(results["models"][name], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# Embedded-model image tasks (judge-scored)", "", f"CPU: {results['cpu']}. `PYTHONPATH=src python "
             f"bench/image_tasks.py --count {args.count}`; each model at its recommended sampler/steps/guidance.", "",
             f"Recolour: a rendered one-object scene + the prompt `a <new colour> <shape>` (no position), img2img at "
             f"strength {args.strength}; the baseline is the same prompt and seed without the picture.", "",
             "| model | run | new colour | shape kept | same place | strict |", "|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        c = r["recolour"]
        for kind, label in (("img2img", "img2img, `a blue circle`"), ("text_only", "text only, same prompt"),
                            ("img2img_positioned", "img2img, prompt with the position")):
            lines.append(f"| {name} | {label} | {c[kind + '_colour']:.3f} | {c[kind + '_shape']:.3f} | "
                         f"{c[kind + '_position']:.3f} | {c[kind + '_strict']:.3f} |")
    first = results["models"]["shapes-sd"]["recolour"]["first_case"]
    lines += ["", f"The issue's case (a red circle on the left, `a blue circle`), shapes-sd: {first['img2img']}; "
              f"shapes-mmdit: {results['models']['shapes-mmdit']['recolour']['first_case']['img2img']}.", "", NOTE]
    lines += ["", "Inpainting: a one-object scene, a mask over the image half of the other slot of its layout, the "
              "two-object caption as the prompt (strength 1.0).", "",
              "| model | asked object in the mask | original kept | strict | PSNR outside the mask, mean / min (dB) "
              "| with mask_overlay: strict, min PSNR outside |", "|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        p = r["inpaint"]
        lines.append(f"| {name} | {p['asked_in_mask']:.3f} | {p['kept_outside']:.3f} | {p['strict']:.3f} | "
                     f"{p['psnr_outside_mean_db']:.2f} / {p['psnr_outside_min_db']:.2f} | {p['strict_overlay']:.3f}, "
                     f"{p['psnr_outside_overlay_min_db']:.1f} |")
    lines += ["", "Without the overlay the pixels outside the mask are the VAE's round trip (33-35 dB on these scenes "
              "alone) plus the decoder's spread across the mask's edge; `mask_overlay` (`--mask-overlay`) pastes them "
              "back."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
