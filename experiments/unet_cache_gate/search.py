"""Issue 25 acceptance 3, the UNet gate: is there a step-caching setting on models/shapes-sd-onnx reaching
>= 1.8x at >= 30 dB mean PSNR with strict accuracy within 1 point of uncached (32 held-out prompts, 1 thread)?

    .venv/bin/python experiments/unet_cache_gate/search.py [--count 32] [--out experiments/unet_cache_gate/results]

Candidates: the shipped DeepCache settings (deepcache:INTERVAL[:BRANCH]) and, as an experiment only, TaylorSeer's
extrapolation on DeepCache's deep path (the span of deepcache:N:1, its output predicted by finite differences
over full steps instead of reused), with the warm-up (full steps before the first prediction) varied so that
5 of 20 steps run the deep path, as deepcache:4 does (the speed the gate needs).  The shipped SD family refuses
taylorseer on a UNet; here its cache_span is wrapped to give the deep path for it.  Reuses bench/cache_pareto.py's
generation and comparison (interleaved prompt by prompt, CPU time per image end to end).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cache_pareto as cp  # noqa: E402
import numpy as np  # noqa: E402

from onnxdiffusion.runtime.cache import CacheSpec  # noqa: E402


# DeepCache with the deep path's full steps chosen (5 of 20 as deepcache:4, placed differently): experiment only
SCHEDULES = [(0, 1, 3, 6, 11), (0, 2, 5, 9, 14), (0, 1, 4, 9, 15), (0, 3, 6, 10, 15), (0, 1, 2, 6, 12),
             (0, 1, 3, 8), (0, 1, 2, 7)]  # the last two: 4 full steps


class _DeepSchedule:
    def __init__(self, spec: CacheSpec):
        self.full, self.feature = set(SCHEDULES[int(spec.threshold)]), None

    def reuse(self, step, f, sg):
        return None if step in self.full or self.feature is None else self.feature

    def update(self, step, f, out, sg):
        self.feature = out


def _allow_taylor_on_unet(pipe) -> None:
    from onnxdiffusion.runtime import cache

    cache._POLICIES["deepsched"] = _DeepSchedule
    fam = pipe.family
    original = fam.cache_span

    def span(method, names, branch=1):
        if method in ("taylorseer", "deepsched"):
            return original("deepcache", names, 1)
        return original(method, names, branch)

    object.__setattr__(fam, "cache_span", span)  # this pipeline's family instance only


def label(spec) -> str:
    if isinstance(spec, CacheSpec) and spec.method == "taylorseer":
        return f"taylor-on-deep:{spec.interval}:{spec.order} warmup {spec.warmup}"
    if isinstance(spec, CacheSpec) and spec.method == "deepsched":
        return "deep-path full at " + ",".join(map(str, SCHEDULES[int(spec.threshold)]))
    return str(spec) if spec else "uncached"


CANDIDATES = [
    "deepcache:4", "deepcache:5",
    CacheSpec("taylorseer", interval=5, order=1, warmup=1),  # full 0, 2, 7, 12, 17
    CacheSpec("taylorseer", interval=4, order=1, warmup=3),  # full 0, 1, 2, 4, 8, 12, 16 (7: slower)
    *(CacheSpec("deepsched", threshold=float(i), interval=99) for i in range(len(SCHEDULES))),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "unet_cache_gate" / "results")
    args = ap.parse_args()
    folder, sampler, steps, guidance, _ = cp.MODELS["sd"]
    pipe = cp.Pipeline.from_folder(ROOT / folder, threads=1)
    _allow_taylor_on_unet(pipe)
    settings = [("fp32", None), *(("fp32", c) for c in CANDIDATES)]
    scenes = cp.heldout_scenes(cp.EvaluateOptions(count=args.count))
    machine = cp.cpu_info()
    images, cpu, full = cp._generate_all({"fp32": pipe}, settings, scenes, sampler, steps, guidance, "sd")
    judge = cp.Judge.from_file(threads=1)
    imgs = {s: np.stack(images[s]) for s in settings}
    acc = {s: float(cp.evaluate_images(imgs[s], scenes, judge)["strict_accuracy"]) for s in settings}
    base = settings[0]
    rows = []
    for s in settings:
        row = {"setting": label(s[1]), "cache": label(s[1]) if s[1] else None, "precision": "fp32",
               "cpu_s_per_image": float(np.median(cpu[s])), "strict_accuracy": acc[s],
               "full_steps_mean": float(np.mean(full[s])),
               **cp._compare(imgs[s], imgs[base], cpu[s], cpu[base], acc[s], acc[base])}
        rows.append(row)
        cp.log(f"{row['setting']}: {row['speedup_median']:.2f}x {row['psnr_mean']:.1f} dB strict {acc[s]:.3f}")
    gate = [r["setting"] for r in rows if r["cache"] and r["speedup_median"] >= cp.GATE_SPEEDUP
            and r["psnr_mean"] >= cp.GATE_PSNR and abs(r["strict_points_vs_uncached"]) <= cp.GATE_POINTS]
    machine["load_after"] = cp.os.getloadavg()[0]
    results = {"machine": machine, "models": {"sd": {
        "folder": folder, "int8_folder": None, "sampler": sampler, "steps": steps, "guidance": guidance,
        "count": args.count, "rows": rows, "gate": {"speedup": cp.GATE_SPEEDUP, "psnr": cp.GATE_PSNR,
                                                     "strict_points": cp.GATE_POINTS, "reference": "uncached",
                                                     "passing": gate}}}}
    cp.write_json(args.out.with_suffix(".json"), results, None)
    md = cp.markdown(results).replace("on the embedded models", "on the embedded UNet, the gate search (experiment)")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
