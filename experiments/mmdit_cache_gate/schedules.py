"""Issue 25 acceptance 3 on the MMDiT: which full-step schedule and stand-in keep every strict verdict at ~6 full
steps of 20 (the count a >= 2x speed-up over int8-static needs; see README.md)?  Quality only (no timing).

    python experiments/mmdit_cache_gate/schedules.py [--int8 WORK] [--count 32] [--out experiments/mmdit_cache_gate/schedules]

The blocks after the first are skipped except on the listed full steps (the residual cache's cut); a cached step
stands in for them with `res` (their residual, output - input, Taylor-extrapolated to ORDER and added to the first
block's fresh output; what `residual:INTERVAL:ORDER` does) or `out` (their output extrapolated; what TaylorSeer
does).  Per candidate: PSNR vs the uncached image (mean, worst) and which held-out prompts changed their strict
verdict.  `--int8 WORK`: on WORK/shapes-mmdit-onnx-int8-static (as bench/cache_pareto.py --int8 builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import cache_pareto as cp  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge, score_scenes  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, heldout_scenes, item_latents  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.techniques.cache_base import CacheSpec, Policy, same_shape  # noqa: E402
from onnxdiffusion.techniques.cache_taylorseer import Taylor, TaylorSeer  # noqa: E402

STEPS = 20


def ramp(first: int, growth: float) -> list[int]:
    """Full steps whose gaps start at `first` and grow by `growth` after each (floored)."""
    p, g, out = 0.0, float(first), []
    while round(p) < STEPS:
        out.append(int(p))
        p, g = p + g, g + growth
    return sorted(set(out))


def power(k: int, e: float) -> list[int]:
    return sorted({round((STEPS - 1) * (i / (k - 1)) ** e) for i in range(k)})


SCHEDULES = {
    "taylorseer:4's": [0, 1, 2, 4, 8, 12, 16], "taylorseer:6's": [0, 1, 2, 4, 10, 16], "every 3rd": list(range(0, 20, 3)),
    "ramp 1,+1 (residual:5)": ramp(1, 1), "ramp 1,+1 up to 4 (residual:4)": [0, 1, 3, 6, 10, 14, 18],
    "ramp 1,+1 up to 3 (residual:3)": [0, 1, 3, 6, 9, 12, 15, 18], "ramp 1,+1 and 19": ramp(1, 1) + [19], "ramp 2,+1": ramp(2, 1),
    "ramp 1,+2": ramp(1, 2), "ramp 1,+0.5": ramp(1, 0.5), "ramp 2,+0.5": ramp(2, 0.5),
    "power 6, ^2": power(6, 2), "power 6, ^1.5": power(6, 1.5), "power 7, ^2": power(7, 2),
}
STAND_INS = [("res", 0), ("res", 1), ("out", 1), ("res", 2)]


class ListedSpec(CacheSpec):
    """This script's own cache method, by name "listed": its policy is `Listed` below. Like `residual`, a cached
    step runs the first piece cut to what it reads."""

    method = "listed"
    prunes_first = True

    @property
    def noop(self) -> bool:
        return False

    def __str__(self) -> str:
        return "listed"

    def policy(self) -> Policy:
        return Listed()


class Listed(Policy):
    """Full steps from a list; cached steps: the residual or the output, Taylor-extrapolated (cache_taylorseer's
    Taylor)."""

    current: dict = {}  # the candidate the next generation runs (set by the caller; the cache builds the policy)

    def __init__(self, spec=None, full: list[int] | None = None, mode: str = "", order: int = 1, damp: float = 1.0):
        if full is None:
            full, mode, order = self.current["full"], self.current["mode"], self.current["order"]
            damp = self.current.get("damp", 1.0)
        self.full, self.mode, self.hidden, self.damp = set(full), mode, None, np.float32(damp)
        self.taylor = Taylor(TaylorSeer(order=order))

    def skips(self, step: int) -> bool:
        return self.hidden is not None and step not in self.full

    def reuse(self, step, f, sg):
        if not self.skips(step):
            return None
        t = self.taylor
        # damp < 1 shrinks the extrapolation toward plain reuse (order 0) over long gaps
        if self.damp != 1 and len(t.factors) == 2:
            pred = t.factors[0] + self.damp * t.factors[1] * np.float32(step - t.last_full)
        else:
            pred = t.predict(step)
        return f[self.hidden] + pred if self.mode == "res" else pred

    def update(self, step, f, out, sg):
        if self.hidden is None:
            self.hidden = same_shape(sg.hidden_in, f, out.shape)
        self.taylor.update(step, f, out - f[self.hidden] if self.mode == "res" else out, sg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--int8", type=Path, default=None, metavar="WORK")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "mmdit_cache_gate" / "schedules")
    args = ap.parse_args()
    folder, sampler, _, guidance, _ = cp.MODELS["mmdit"]
    path = ROOT / folder if args.int8 is None else cp.int8_folder(folder, args.int8)
    pipe = Pipeline.from_folder(path, threads=1)
    scenes = heldout_scenes(EvaluateOptions(count=args.count))
    judge = Judge.from_file(threads=1)
    shape = pipe.latent_shape_for(1)[1:]
    current = Listed.current

    def images(spec):
        return np.stack([pipe(sc.caption, steps=STEPS, sampler=sampler, guidance=guidance, seed=i, cache=spec,
                              latents=item_latents(shape, [i])).images[0] for i, sc in enumerate(scenes)])

    def verdicts(ims):
        return np.array([s["strict"] for s in score_scenes(scenes, judge.predict(ims))])

    ref = images(None)
    want = verdicts(ref)
    rows = []
    for name, full in SCHEDULES.items():
        for mode, order in STAND_INS:
            current.update(full=full, mode=mode, order=order)
            ims = images(ListedSpec())
            ps = [psnr(a[None], b[None]) for a, b in zip(ims, ref)]
            rows.append({"schedule": name, "full_steps": full, "stand_in": f"{mode} order {order}",
                         "psnr_mean": float(np.mean(ps)), "psnr_worst": float(min(ps)),
                         "flipped": np.flatnonzero(verdicts(ims) != want).tolist()})
            cp.log(f"{name} {mode}{order}: {rows[-1]['psnr_mean']:.1f} dB, flipped {rows[-1]['flipped']}")
    machine = cp.cpu_info()
    machine["load_after"] = os.getloadavg()[0]
    result = {"machine": machine, "folder": folder if args.int8 is None else "WORK/shapes-mmdit-onnx-int8-static",
              "uncached_strict": float(want.mean()), "count": args.count, "rows": rows}
    cp.write_json(args.out.with_suffix(".json"), result, None)
    lines = [f"# MMDiT step caching: full-step schedules x stand-ins ({result['folder']}, flow_euler {STEPS} steps, "
             f"guidance {guidance}, {args.count} held-out prompts)", "",
             f"Quality only; uncached strict accuracy {want.mean():.3f}. Regenerate: `python "
             f"experiments/mmdit_cache_gate/schedules.py{' --int8 WORK' if args.int8 else ''}`.", "",
             "| schedule | full steps | stand-in | PSNR mean | PSNR worst | verdicts changed (prompt index) |",
             "|---|---|---|---:|---:|---|"]
    lines += [f"| {r['schedule']} | {','.join(map(str, r['full_steps']))} ({len(r['full_steps'])}) | {r['stand_in']} | "
              f"{r['psnr_mean']:.1f} | {r['psnr_worst']:.1f} | {len(r['flipped'])}: {r['flipped'] or '-'} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
