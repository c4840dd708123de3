"""Issue 25 acceptance 3, int8-static MMDiT: choose the cached-step schedule on TUNING prompts only (held-out
items 160 onward, disjoint from the 32 gate prompts, items 0-31, and from fresh_prompts.py's 32-159), so the gate
measurement that follows is not the set the schedule was picked on.  Quality only (no timing).

    PYTHONPATH=src python experiments/mmdit_cache_gate/tune_split.py --int8 WORK [--stages 160:32,192:96,288:128]
        [--keep 12,3]

Candidates: every FULL-step list of the 20 steps (--full, default 6) whose gaps start at 1 or 2 and grow by 0-2
after each, last full step FULL+6 .. FULL+11 (60 lists of 6, 76 of 7), x stand-ins (--stand-ins: residual order 0
and 1, output order 1; samplers/schedules.py's `Listed`).  Successive halving: every candidate on the first stage's
prompts, the best `keep[k]` on the next stage's too, ranked by verdicts lost, then verdicts changed, then mean
PSNR, all summed over the stages seen.  Resumable: each (candidate, stage) result is kept in tune_split.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import schedules as sch  # noqa: E402  (puts src/ and bench/ on the path)

cp = sch.cp
from onnxdiffusion.techniques import caching as cm  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge, score_scenes  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes, item_latents  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

def step_lists(full: int = 6) -> list[list[int]]:
    out = []

    def grow(pts, gap):
        if len(pts) == full:
            if full + 6 <= pts[-1] <= full + 11:
                out.append(pts)
            return
        for g in range(gap, gap + 3):
            if pts[-1] + g < sch.STEPS:
                grow(pts + [pts[-1] + g], g)

    for first in (1, 2):
        grow([0, first], first)
    return out


def ramp_steps(spec) -> list[int]:
    """The full steps of `residual:INTERVAL` (gaps 1, 2, ... up to INTERVAL)."""
    out, step, gap = [], 0, 1
    while step < sch.STEPS:
        out.append(step)
        step, gap = step + gap, min(gap + 1, spec.interval)
    return out


def item_runners(pipe, judge, start: int, count: int):
    """(scenes, images(cache spec), verdicts(images)) for held-out items start .. start+count-1 of the MMDiT."""
    _, sampler, _, guidance, _ = cp.MODELS["mmdit"]
    shape = pipe.latent_shape_for(1)[1:]
    scenes = heldout_scenes(EvaluateOptions(count=start + count))[start:]

    def images(spec):
        return np.stack([pipe(sc.caption, steps=sch.STEPS, sampler=sampler, guidance=guidance, seed=start + j,
                              cache=spec, latents=item_latents(shape, [start + j])).images[0]
                         for j, sc in enumerate(scenes)])

    def verdicts(ims):
        return np.array([bool(s["strict"]) for s in score_scenes(scenes, judge.predict(ims))])

    return scenes, images, verdicts


def key(full, mode, order, damp=1.0) -> str:
    return f"{','.join(map(str, full))}|{mode}{order}" + ("" if damp == 1 else f"@{damp:g}")


def rank(entry: dict) -> tuple:
    seen = entry["stages"].values()
    return (sum(s["lost"] for s in seen), sum(len(s["flipped"]) for s in seen),
            -np.mean([s["psnr_mean"] for s in seen]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--int8", type=Path, required=True, metavar="WORK")
    ap.add_argument("--stages", default="160:32,192:96,288:128")
    ap.add_argument("--keep", default="12,3")
    ap.add_argument("--full", type=int, default=6, help="full steps of the 20")
    ap.add_argument("--stand-ins", default="res1,out1,res0", help="MODE ORDER[@DAMP], e.g. res1@0.5")
    ap.add_argument("--ramps", default=None, help="only the ramps of these residual intervals (e.g. 5,4)")
    ap.add_argument("--specs", default=None, help="product cache settings as the candidates instead (comma-separated)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.out = args.out or HERE / ("tune_split_product" if args.specs else "tune_split_damped" if args.ramps
                                   else "tune_split" if args.full == 6 else f"tune_split_{args.full}")
    stand_ins = []
    for t in args.stand_ins.split(","):
        t, _, damp = t.partition("@")
        stand_ins.append((t[:-1], int(t[-1]), float(damp or 1)))
    stages = [tuple(map(int, s.split(":"))) for s in args.stages.split(",")]
    keep = [int(k) for k in args.keep.split(",")]
    folder = cp.MODELS["mmdit"][0]
    pipe = Pipeline.from_folder(cp.int8_folder(folder, args.int8), threads=1)
    judge = Judge.from_file(threads=1)
    path = args.out.with_suffix(".json")
    state = json.loads(path.read_text()) if path.exists() else {"candidates": {}}
    cands = state["candidates"]
    for spec in (args.specs.split(",") if args.specs else []):
        cands.setdefault(spec, {"spec": spec, "full": ramp_steps(cm.parse_cache(spec)), "mode": spec, "order": "",
                                "stages": {}})
    lists = ([ramp_steps(cm.parse_cache(f"residual:{r}")) for r in args.ramps.split(",")] if args.ramps
             else step_lists(args.full))
    for full in ([] if args.specs else lists):
        for mode, order, damp in stand_ins:
            cands.setdefault(key(full, mode, order, damp), {"full": full, "mode": mode, "order": order, "damp": damp,
                                                            "stages": {}})
    alive = list(cands)
    for k, (start, count) in enumerate(stages):
        scenes, images, verdicts = item_runners(pipe, judge, start, count)
        ref = images(None)
        want = verdicts(ref)
        tag = f"{start}:{count}"
        for n, name in enumerate(alive):
            c = cands[name]
            if tag in c["stages"]:
                continue
            sch.Listed.current.update(full=c["full"], mode=c["mode"], order=c["order"], damp=c.get("damp", 1.0))
            ims = images(c.get("spec") or sch.ListedSpec())
            got = verdicts(ims)
            ps = [psnr(a[None], b[None]) for a, b in zip(ims, ref)]
            c["stages"][tag] = {"psnr_mean": float(np.mean([p for p in ps if np.isfinite(p)])), "psnr_worst": float(min(ps)),
                                "lost": int((want & ~got).sum()), "gained": int((~want & got).sum()),
                                "flipped": [start + int(i) for i in np.flatnonzero(got != want)],
                                "strict_uncached": float(want.mean())}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=0) + "\n")
            tmp.replace(path)
            cp.log(f"stage {tag} {n + 1}/{len(alive)} {name}: lost {c['stages'][tag]['lost']}, "
                   f"{c['stages'][tag]['psnr_mean']:.1f} dB")
        alive.sort(key=lambda n: rank(cands[n]))
        if k < len(keep):
            alive = alive[: keep[k]]
    state["machine"] = cp.cpu_info()
    state["machine"]["load_after"] = os.getloadavg()[0]
    state["stages"], state["keep"], state["chosen"] = args.stages, args.keep, alive[0]
    path.write_text(json.dumps(state, indent=0) + "\n")
    write_md(args.out.with_suffix(".md"), state, stages)


def write_md(path: Path, state: dict, stages) -> None:
    cands = state["candidates"]
    tags = [f"{s}:{c}" for s, c in stages]
    names = sorted(cands, key=lambda n: (-len(cands[n]["stages"]), rank(cands[n])))
    lines = [f"# Choosing the int8-static MMDiT cache schedule on tuning prompts (held-out items {stages[0][0]}-"
             f"{stages[-1][0] + stages[-1][1] - 1}, disjoint from the gate's 0-31)", "",
             f"CPU: {state['machine']['cpu']}; quality only; flow_euler {sch.STEPS} steps, {len(cands[state['chosen']]['full'])} full steps. "
             f"Successive halving over stages {state['stages']} (keeping {state['keep']}). "
             "Regenerate: `PYTHONPATH=src python experiments/mmdit_cache_gate/tune_split.py --int8 WORK`.", "",
             f"**Chosen: {state['chosen']}** (fewest verdicts lost over every tuning stage, then fewest changed, then PSNR).", "",
             "| full steps | stand-in | " + " | ".join(f"items {t}: lost / changed / PSNR" for t in tags) + " |",
             "|---|---|" + "---:|" * len(tags)]
    for n in names[:40]:
        c = cands[n]
        cells = [f"{s['lost']} / {len(s['flipped'])} / {s['psnr_mean']:.1f}" if (s := c["stages"].get(t)) else "" for t in tags]
        stand_in = f"`{c['spec']}`" if "spec" in c else f"{c['mode']} order {c['order']}" + (
            f" damped {c['damp']:g}" if c.get("damp", 1) != 1 else "")
        lines.append(f"| {','.join(map(str, c['full']))} | {stand_in} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"({len(cands)} candidates; the 40 that went furthest, best first.)")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
