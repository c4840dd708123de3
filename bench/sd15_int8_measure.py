#!/usr/bin/env python
"""Full-size (SD1.5-sized, random weights) int8 vs fp32 vs diffusers eager: step time, end to end, peak RSS.

Each measurement is a fresh child process (never two at once: at full size each holds 2-5 GB) that
loads one variant with ONE thread, times backbone calls on a fixed batch-2 256x256 feed (warm-up
call first), generates one 256x256 image (DDIM 10 steps, guidance 7.5), and reports wall time and
the process's CPU time (user + sys: on a shared machine the contention-robust figure) for both,
plus VmHWM (peak RSS: load + calls + image) and the peak of each phase (load, backbone calls, image;
the kernel's high-water mark is reset between them). Rounds interleave the variants; medians are reported.

    python bench/sd15_int8_measure.py --variant fp32=runs/sd15/onnx256 --variant int8-static=runs/sd15/int8-static \\
        --diffusers runs/sd15/diffusers --rounds 3 --out bench/report_sd15/int8_static_threads1.json

`--variant NAME=FOLDER@MEMORY` loads the folder with `Pipeline.from_folder(memory=MEMORY)` (`lean`,
`release_text_encoders=1`, `prepacking=0,arena=0`, ...: runtime/memory.py).

Folder paths are recorded as given (pass them relative to the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZE, STEPS, GUIDANCE, PROMPT = 256, 10, 7.5, "a photo of an astronaut riding a horse"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _phase_peak() -> int:
    """VmHWM since the last reset, then reset it (Linux: writing 5 to clear_refs resets the high-water mark)."""
    peak = _status_kb("VmHWM") * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return peak


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _timed(fn):
    w, c = time.perf_counter(), _cpu()
    out = fn()
    return out, time.perf_counter() - w, _cpu() - c


def child_ours(folder: str, calls: int) -> dict:
    folder, _, memory = folder.partition("@")
    import numpy as np

    from onnxdiffusion.artifacts import read_manifest
    from onnxdiffusion.families import get_family
    from onnxdiffusion.quantize.report import component_feed
    from onnxdiffusion.runtime import Pipeline

    _phase_peak()
    pipe, load_wall, load_cpu = _timed(lambda: Pipeline.from_folder(folder, provider="cpu", threads=1,
                                                                    memory=memory or None))
    phases = {"load": _phase_peak()}
    rss_after_load = _status_kb("VmRSS") * 1024
    manifest = read_manifest(Path(folder))
    feed = component_feed(get_family(manifest.get("family")).backbone, manifest)
    feed = {k: v for k, v in feed.items()}
    _, warm_wall, warm_cpu = _timed(lambda: pipe.backbone.run(None, feed))
    step_wall, step_cpu = [], []
    for _ in range(calls):
        _, w, c = _timed(lambda: pipe.backbone.run(None, feed))
        step_wall.append(w)
        step_cpu.append(c)
    phases["backbone_calls"] = _phase_peak()
    result, e2e_wall, e2e_cpu = _timed(lambda: pipe([PROMPT], steps=STEPS, sampler="ddim", guidance=GUIDANCE, seed=0,
                                                   height=SIZE, width=SIZE))
    phases["image"] = _phase_peak()
    assert np.isfinite(result.latents).all()
    return {"load_wall_s": load_wall, "load_cpu_s": load_cpu, "warmup_call_wall_s": warm_wall,
            "step_wall_s": step_wall, "step_cpu_s": step_cpu, "e2e_wall_s": e2e_wall, "e2e_cpu_s": e2e_cpu,
            "peak_rss_bytes": max(phases.values()), "phase_peak_rss_bytes": phases,
            "rss_after_load_bytes": rss_after_load, "memory": pipe.memory.to_dict(),
            "image_sha256": __import__("hashlib").sha256(result.images.tobytes()).hexdigest()}


def child_diffusers(folder: str, calls: int) -> dict:
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)

    def load():
        p = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, safety_checker=None)
        p.scheduler = DDIMScheduler.from_config(p.scheduler.config)
        p.set_progress_bar_config(disable=True)
        return p

    pipe, load_wall, load_cpu = _timed(load)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        sample = torch.randn((2, 4, SIZE // 8, SIZE // 8), generator=gen)
        ctx = torch.randn((2, 77, 768), generator=gen)
        t = torch.tensor([500, 500])
        _, warm_wall, _ = _timed(lambda: pipe.unet(sample, t, ctx))
        step_wall, step_cpu = [], []
        for _ in range(calls):
            _, w, c = _timed(lambda: pipe.unet(sample, t, ctx))
            step_wall.append(w)
            step_cpu.append(c)
        _, e2e_wall, e2e_cpu = _timed(lambda: pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE,
                                                   width=SIZE, generator=torch.Generator().manual_seed(0), output_type="np"))
    return {"load_wall_s": load_wall, "load_cpu_s": load_cpu, "warmup_call_wall_s": warm_wall,
            "step_wall_s": step_wall, "step_cpu_s": step_cpu, "e2e_wall_s": e2e_wall, "e2e_cpu_s": e2e_cpu,
            "peak_rss_bytes": _status_kb("VmHWM") * 1024}


def run_child(kind: str, folder: str, calls: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, folder, "--calls", str(calls)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}, timeout=3000)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return {"error": tail}
    return json.loads(lines[-1])


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error") if runs else "not run"}
    med = lambda key: statistics.median(x for r in ok for x in (r[key] if isinstance(r[key], list) else [r[key]]))  # noqa: E731
    out = {"runs": len(ok), "step_wall_s": med("step_wall_s"), "step_cpu_s": med("step_cpu_s"),
           "e2e_wall_s": med("e2e_wall_s"), "e2e_cpu_s": med("e2e_cpu_s"),
           "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok), "load_wall_s": med("load_wall_s"),
           "load_cpu_s": med("load_cpu_s")}
    if all("phase_peak_rss_bytes" in r for r in ok):
        out["phase_peak_rss_bytes"] = {k: max(r["phase_peak_rss_bytes"][k] for r in ok) for k in ok[0]["phase_peak_rss_bytes"]}
        out["image_sha256"] = sorted({r["image_sha256"] for r in ok})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], help="NAME=FOLDER (an onnxdiffusion model folder)")
    ap.add_argument("--diffusers", help="the diffusers folder the ONNX folders were exported from (a peer row)")
    ap.add_argument("--diffusers-rounds", type=int, default=1, help="rounds that include the diffusers row")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3, help="timed backbone calls per child (after one warm-up)")
    ap.add_argument("--out", type=Path, help="results JSON (required unless --child)")
    ap.add_argument("--work", help="a folder the paths are under: written as $WORK in the results (no machine paths)")
    args = ap.parse_args()
    if args.child:
        fn = child_ours if args.child[0] == "ours" else child_diffusers
        print(json.dumps(fn(args.child[1], args.calls)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    raw: dict[str, list] = {name: [] for name, _ in variants}
    if args.diffusers:
        raw["diffusers-eager-fp32"] = []
    log = []
    for r in range(args.rounds):
        order = list(variants) + ([("diffusers-eager-fp32", args.diffusers)] if args.diffusers and r < args.diffusers_rounds else [])
        for name, folder in order:
            before = _loadavg()
            rec = run_child("diffusers" if name.startswith("diffusers") else "ours", folder, args.calls)
            rec.update(round=r, loadavg_before=before, loadavg_after=_loadavg())
            raw[name].append(rec)
            log.append(f"round {r} {name}: " + (rec.get("error") or
                       f"step {statistics.median(rec['step_cpu_s']):.2f} s CPU / {statistics.median(rec['step_wall_s']):.2f} s wall, "
                       f"e2e {rec['e2e_cpu_s']:.1f} s CPU / {rec['e2e_wall_s']:.1f} s wall, peak {rec['peak_rss_bytes'] / 1e9:.2f} GB"))
            print(log[-1], file=sys.stderr, flush=True)
            out = {"settings": {"size": SIZE, "steps": STEPS, "sampler": "ddim", "guidance": GUIDANCE, "batch": 1,
                                "threads": 1, "calls_per_child": args.calls, "rounds": args.rounds},
                   "folders": dict(variants) | ({"diffusers-eager-fp32": args.diffusers} if args.diffusers else {}),
                   "summary": {k: summarize(v) for k, v in raw.items()}, "raw": raw, "log": log}
            text = json.dumps(out, indent=2) + "\n"
            if args.work:
                text = text.replace(str(Path(args.work).resolve()), "$WORK")
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
