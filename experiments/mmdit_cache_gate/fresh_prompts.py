#!/usr/bin/env python
"""Out-of-sample check of the MMDiT cache gate's setting: the schedule of `residual:INTERVAL` was chosen with the
32 held-out prompts that the gate is measured on (schedules.md); this runs the same verdict/PSNR comparison on
held-out prompts that took no part in that choice (held-out items 32 onward), quality only (no timing).

    PYTHONPATH=src python experiments/mmdit_cache_gate/fresh_prompts.py --int8 WORK [--start 32 --count 128]

Writes fresh_prompts.{md,json} here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from cache_pareto import MODELS, cpu_info, int8_folder  # noqa: E402

from onnxdiffusion.evaluate.judge import Judge, score_scenes  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes, item_latents  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402


def verdicts(judge: Judge, images: np.ndarray, scenes) -> np.ndarray:
    return np.array([bool(s["strict"]) for s in score_scenes(scenes, judge.predict(images))])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int8", type=Path, required=True, metavar="WORK")
    ap.add_argument("--model", default="mmdit", choices=list(MODELS))
    ap.add_argument("--spec", default="residual:5")
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--count", type=int, default=128)
    args = ap.parse_args()
    folder, sampler, steps, guidance, _ = MODELS[args.model]
    pipes = {"fp32": Pipeline.from_folder(ROOT / folder, threads=1),
             "int8": Pipeline.from_folder(int8_folder(folder, args.int8), threads=1)}
    scenes = heldout_scenes(EvaluateOptions(count=args.start + args.count))[args.start:]
    shape = pipes["fp32"].latent_shape_for(1)[1:]
    images = {(p, s): [] for p in pipes for s in (None, args.spec)}
    for j, sc in enumerate(scenes):
        i = args.start + j
        lat = item_latents(shape, [i])
        for p, s in images:
            r = pipes[p](sc.caption, steps=steps, sampler=sampler, guidance=guidance, latents=lat, seed=i, cache=s)
            images[(p, s)].append(r.images[0])
        if j % 16 == 15:
            print(f"{j + 1}/{len(scenes)}", file=sys.stderr, flush=True)
    judge = Judge.from_file(threads=1)
    suffix = ("" if args.model == "mmdit" else f"_{args.model}") + ("" if args.spec == "residual:5" else
                                                                     "_" + args.spec.replace(":", "-"))
    out = {"model": args.model, "machine": cpu_info(), "spec": args.spec, "items": [args.start, args.start + args.count], "rows": {}}
    for p in pipes:
        ref, got = np.stack(images[(p, None)]), np.stack(images[(p, args.spec)])
        v_ref, v_got = verdicts(judge, ref, scenes), verdicts(judge, got, scenes)
        ps = [psnr(a[None], b[None]) for a, b in zip(got, ref)]
        out["rows"][p] = {"strict_uncached": float(v_ref.mean()), "strict_cached": float(v_got.mean()),
                          "points": float(100 * (v_got.mean() - v_ref.mean())),
                          "flipped": int((v_ref != v_got).sum()),
                          "lost": int((v_ref & ~v_got).sum()), "gained": int((~v_ref & v_got).sum()),
                          "psnr_mean": float(np.mean([x for x in ps if np.isfinite(x)])), "psnr_worst": float(min(ps))}
    (HERE / f"fresh_prompts{suffix}.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# {args.model} `{args.spec}` on held-out prompts the schedule was not chosen on (items {args.start}-"
             f"{args.start + args.count - 1})", "",
             f"CPU: {out['machine']['cpu']}; quality only. Cached vs the same precision uncached, same latents and seeds.", "",
             "| precision | strict uncached | strict cached | points | verdicts lost / gained | PSNR mean / worst |",
             "|---|---:|---:|---:|---:|---:|"]
    for p, r in out["rows"].items():
        lines.append(f"| {p} | {r['strict_uncached']:.3f} | {r['strict_cached']:.3f} | {r['points']:+.1f} | "
                     f"{r['lost']} / {r['gained']} | {r['psnr_mean']:.1f} / {r['psnr_worst']:.1f} |")
    (HERE / f"fresh_prompts{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
