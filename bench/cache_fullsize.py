"""Step caching at full size (issue 25, acceptance 4): random-weight backbones built by the package's arch builders,
1 thread, speed only (the images are noise).

    python -m onnxdiffusion.bench.arch.sd15 build /tmp/sd15 && python -m onnxdiffusion.bench.arch.sd15 export /tmp/sd15
    python bench/cache_fullsize.py /tmp/sd15/onnx --specs deepcache:2 deepcache:3 deepcache:5 --steps 10 \
        --out bench/results/cache_fullsize_sd15
    python -m onnxdiffusion.bench.arch.fullwidth build sd3 /tmp/sd3/diffusers --profile bench && \
        onnxdiffusion export /tmp/sd3/diffusers /tmp/sd3/onnx --no-validate --default-size 256
    python bench/cache_fullsize.py /tmp/sd3/onnx --specs first_block:0.6 first_block:0.7 --steps 6 \
        --out bench/results/cache_fullsize_sd3
    python bench/cache_fullsize.py --render bench/results/cache_fullsize_sd15.json bench/results/cache_fullsize_sd3.json \
        --out bench/results/cache_fullsize

One pipeline, loaded once (sessions made and every cut built in a warm-up image); then ROUNDS rounds, each one image
per setting (uncached first, the order rotated each round), batch 1, fixed seed and latents.  Per image: process CPU
time end to end (text encoding + sampling + decoding) and the CPU time of each backbone call (a full step, or a
cached one: first piece + tail); speed-up = median over rounds of uncached / cached CPU time.  The projection to
the released depth (transformers built by bench.arch.fullwidth) scales the measured cost per block: sampling only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from cache_pareto import cpu_info, log  # noqa: E402

from onnxdiffusion.folder.artifacts import write_json  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.runtime import backbone as backbone_mod  # noqa: E402
from onnxdiffusion.techniques import caching as cache_mod  # noqa: E402

PROMPT = "a red circle on the left and a blue square on the right"


def _timed_calls(record: list):
    """Wrap both model functions so each backbone call's CPU time and kind (full / cached) is recorded."""
    plain, cached = backbone_mod.GuidedBackbone.__call__, cache_mod.CachedBackbone.__call__

    def time_plain(self, x, t):
        t0 = time.process_time()
        out = plain(self, x, t)
        record.append(("full", time.process_time() - t0))
        return out

    def time_cached(self, x, t):
        before = self.computed
        t0 = time.process_time()
        out = cached(self, x, t)
        record.append(("full" if self.computed > before else "cached", time.process_time() - t0))
        return out

    backbone_mod.GuidedBackbone.__call__ = time_plain
    cache_mod.CachedBackbone.__call__ = time_cached


def _projection(res: dict, row: dict) -> str:
    """Sampling-only speed-up at the released depth R from the measured per-step costs at depth D: a full step
    is c0 + D*b, a cached one c0 + b (embedding, first block, output head), so b = (full - cached) / (D - 1)."""
    desc = res.get("fullwidth")
    if not desc or not isinstance(desc["backbone_depth"], int) or row["cached_step_cpu_median"] is None:
        return "-"
    d, r = desc["backbone_depth"], desc["released_depth"]
    full, cached = row["full_step_cpu_median"], row["cached_step_cpu_median"]
    b = (full - cached) / (d - 1)
    full_r = cached - b + r * b
    n, k = row.get("calls", row["steps"]), row["full_steps"]
    return f"{n * full_r / (k * full_r + (n - k) * cached):.2f}x at {r} blocks"


def render(paths: list[Path], out: Path) -> None:
    """OUT.md: one table per JSON this script wrote."""
    lines = ["# Step caching at full size (random weights, 1 thread)", "",
             "Written by `bench/cache_fullsize.py --render` from " + ", ".join(f"`{p.name}`" for p in paths) + ". "
             "CPU time per image end to end (text encoding + sampling + decoding), batch 1, one image per setting per "
             "round, rounds interleaved; speed-up = median over rounds of uncached / cached. Step CPU: the median "
             "backbone call of the run (a full step, or a cached one: the cut's first piece + tail).", ""]
    for p in paths:
        res = json.loads(p.read_text())
        m = res["machine"]
        lines += [f"## {res['label']}", "",
                  f"{res['size']}x{res['size']}, {res['steps']} steps ({res.get('sampler', '')}), {res['rounds']} rounds. "
                  f"CPU: {m['cpu']} "
                  f"({', '.join(f for f in m['isa'] if f in ('avx512_vnni', 'avx512_bf16') or f.startswith('amx')) or 'no VNNI/AMX'}"
                  f"), {m['cores']} cores; ONNX Runtime {m['onnxruntime']}; load average (1 min) before / after: "
                  f"{m['load_before']:.1f} / {m['load_after']:.1f}.", "",
                  "| setting | full / backbone calls | CPU s / image (median) | speed-up | full step CPU s | cached step CPU s | "
                  "sampling speed-up projected |", "|---|---:|---:|---:|---:|---:|---:|"]
        for row in res["rows"]:
            f = (lambda v: "-" if v is None else f"{v:.2f}")
            lines.append(f"| {row['setting']} | {row['full_steps']}/{row.get('calls', row['steps'])} | {row['cpu_s_median']:.1f} | "
                         f"{row['speedup_median']:.2f}x | {f(row['full_step_cpu_median'])} | "
                         f"{f(row['cached_step_cpu_median'])} | {_projection(res, row)} |")
        lines.append("")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path, nargs="?")
    ap.add_argument("--render", nargs="+", type=Path, default=None, metavar="JSON",
                    help="only write OUT.md from these results")
    ap.add_argument("--specs", nargs="+", default=[])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--guidance", type=float, default=None, help="default: the model's")
    ap.add_argument("--sampler", default=None, help="default: the folder's scheduler's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default=None, help="what the folder is, for the report (default: its fullwidth.json)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.render:
        render(args.render, args.out.with_suffix(".md"))
        return
    if args.folder is None or not args.specs:
        ap.error("FOLDER and --specs are needed (or --render JSON ...)")
    machine = cpu_info()
    t0 = time.process_time()
    pipe = Pipeline.from_folder(args.folder, threads=1, verify=False)
    load_cpu = time.process_time() - t0
    calls: list = []
    _timed_calls(calls)
    kw = dict(steps=args.steps, height=args.size, width=args.size, seed=0)
    if args.guidance is not None:
        kw["guidance"] = args.guidance
    if args.sampler is not None:
        kw["sampler"] = args.sampler
    settings = [None, *args.specs]
    log(f"loaded in {load_cpu:.1f} s CPU; warm-up")
    for s in settings:
        pipe(PROMPT, **{**kw, "steps": 2}, cache=s)
    per = {s: {"cpu": [], "full_step_cpu": [], "cached_step_cpu": [], "full_steps": 0, "calls": 0} for s in settings}
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for s in order:
            calls.clear()
            t0 = time.process_time()
            pipe(PROMPT, **kw, cache=s)
            cpu = time.process_time() - t0
            d = per[s]
            d["cpu"].append(cpu)
            d["full_step_cpu"] += [c for k, c in calls if k == "full"]
            d["cached_step_cpu"] += [c for k, c in calls if k == "cached"]
            d["full_steps"] = sum(k == "full" for k, _ in calls)
            d["calls"] = len(calls)
            log(f"round {r + 1} {s or 'uncached'}: {cpu:.1f} s CPU, {d['full_steps']}/{len(calls)} full steps")
    base = per[None]["cpu"]
    rows = []
    for s in settings:
        d = per[s]
        rows.append({"setting": s or "uncached", "cpu_s_median": float(np.median(d["cpu"])), "cpu_s": d["cpu"],
                     "speedup_median": float(np.median([b / c for b, c in zip(base, d["cpu"])])),
                     "full_steps": d["full_steps"], "calls": d["calls"], "steps": args.steps,
                     "full_step_cpu_median": float(np.median(d["full_step_cpu"])) if d["full_step_cpu"] else None,
                     "cached_step_cpu_median": float(np.median(d["cached_step_cpu"])) if d["cached_step_cpu"] else None})
    machine["load_after"] = os.getloadavg()[0]
    desc_path = args.folder.parent / "diffusers" / "fullwidth.json"
    desc = json.loads(desc_path.read_text()) if desc_path.exists() else None
    results = {"machine": machine, "label": args.label or (f"{desc['arch']} at its released width, "
               f"{desc['backbone_depth']} of {desc['released_depth']} blocks" if desc else args.folder.name),
               "fullwidth": desc, "sampler": args.sampler or "the folder's scheduler's", "size": args.size, "steps": args.steps, "rounds": args.rounds,
               "load_cpu_s": load_cpu, "rows": rows}
    write_json(args.out.with_suffix(".json"), results, None)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
