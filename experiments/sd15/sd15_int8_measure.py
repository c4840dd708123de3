#!/usr/bin/env python
"""Full-size (SD1.5-sized, random weights) int8 vs fp32 vs diffusers eager: step time, end to end, peak RSS.

Each measurement is a fresh child process (never two at once: at full size each holds 2-5 GB) that
loads one variant with ONE thread, times backbone calls on a fixed batch-2 256x256 feed (warm-up
call first), generates one 256x256 image (DDIM 10 steps, guidance 7.5), and reports wall time and
the process's CPU time (user + sys: on a shared machine the contention-robust figure) for both,
plus VmHWM (peak RSS: load + calls + image) and the peak of each phase (load, backbone calls, image;
the kernel's high-water mark is reset between them). Rounds interleave the variants; medians are reported.
--threads N runs every process with N threads (default ONE; CPU time then counts all its threads).

Peers (--peer NAME=BACKEND:MODE, BACKEND openvino or sdcpp) run in their own venvs through
onnxdiffusion/bench/peer_worker.py (the bench's worker, JSON lines): a fresh worker per round loads the
converted model from --peer-cache (OpenVINO IR / GGUF, converted there on first use), makes one image and
reports its VmHWM. Their step is the median sampling step seen by the pipeline's step callback (UNet on
the classifier-free-guidance pair + scheduler update), not a separate backbone call. The peers' Pythons:
ONNXDIFFUSION_SDCPP_PYTHON / ONNXDIFFUSION_OPENVINO_PYTHON, else .venv-sdcpp / .venv-openvino
(bench/install_sdcpp.sh, bench/install_openvino.sh).

    python experiments/sd15/sd15_int8_measure.py ... --peer sdcpp-q8_0=sdcpp:q8_0 --peer openvino-int8-hybrid=openvino:int8-hybrid \\
        --peer-cache runs/sd15/peers --threads 2 --out bench/report_sd15/peers_threads2.json

    python experiments/sd15/sd15_int8_measure.py --variant fp32=runs/sd15/onnx256 --variant int8-static=runs/sd15/int8-static \\
        --diffusers runs/sd15/diffusers --rounds 3 --out bench/report_sd15/int8_static_threads1.json

`--variant NAME=FOLDER@MEMORY` loads the folder with `Pipeline.from_folder(memory=MEMORY)` (`lean`,
`release_text_encoders=1`, `prepacking=0,arena=0`, ...: runtime/memory.py); `NAME=FOLDER%PROFILE` with that hardware
profile (a name or YAML file), in the interpreter `--profile-python` names (e.g. a venv with onnxruntime-openvino).

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

from onnxdiffusion.folder.artifacts import write_json
from onnxdiffusion.bench.machine import machine_facts
from onnxdiffusion.bench.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

SIZE, STEPS, GUIDANCE, PROMPT = 256, 10, 7.5, "a photo of an astronaut riding a horse"
ROOT = Path(__file__).resolve().parents[2]
PEER_WORKER = ROOT / "src" / "onnxdiffusion" / "bench" / "peer_worker.py"
PEER_VENVS = {"openvino": ".venv-openvino", "sdcpp": ".venv-sdcpp", "optimum": ".venv-optimum"}
# the sampler each peer runs (peer_worker.py): sd.cpp has no leading-spacing DDIM; same UNet calls per step
PEER_SAMPLERS = {"openvino": "DDIM (diffusers DDIMScheduler, the model's config)", "optimum": "DDIM (diffusers DDIMScheduler)",
                 "sdcpp": "ddim_trailing (sd.cpp's DDIM, trailing timestep spacing, discrete schedule)"}
CALIB_PROMPTS = ["a photo of an astronaut riding a horse", "a red car parked by the sea", "a bowl of fruit on a table",
                 "a mountain lake at sunrise"]


def thread_env(threads: int) -> dict:
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "HF_HUB_OFFLINE": "1"}


def _phase_peak() -> int:
    """VmHWM since the last reset, then reset it."""
    peak = peak_rss_bytes()
    reset_peak_rss()
    return peak


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _timed(fn):
    w, c = time.perf_counter(), _cpu()
    out = fn()
    return out, time.perf_counter() - w, _cpu() - c


def child_ours(folder: str, calls: int, threads: int) -> dict:
    folder, _, profile = folder.partition("%")
    folder, _, memory = folder.partition("@")
    import numpy as np

    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.families import get_family
    from onnxdiffusion.quantize.report import component_feed
    from onnxdiffusion.runtime import Pipeline

    _phase_peak()
    pipe, load_wall, load_cpu = _timed(lambda: Pipeline.from_folder(folder, provider="cpu", threads=threads,
                                                                    memory=memory or None, profile=profile or None))
    phases = {"load": _phase_peak()}
    rss_after_load = current_rss_bytes()
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
    def image():
        return pipe([PROMPT], steps=STEPS, sampler="ddim", guidance=GUIDANCE, seed=0, height=SIZE, width=SIZE)

    result, e2e_wall, e2e_cpu = _timed(image)
    phases["image"] = _phase_peak()
    assert np.isfinite(result.latents).all()
    # the same image again: what a served pipeline pays per image (a provider that compiles a component on its
    # first call, OpenVINO's, pays that inside the first image; OpenVINO's own pipeline compiles at load)
    _, e2e2_wall, e2e2_cpu = _timed(image)
    return {"load_wall_s": load_wall, "load_cpu_s": load_cpu, "warmup_call_wall_s": warm_wall,
            "step_wall_s": step_wall, "step_cpu_s": step_cpu, "e2e_wall_s": e2e_wall, "e2e_cpu_s": e2e_cpu,
            "e2e_second_wall_s": e2e2_wall, "e2e_second_cpu_s": e2e2_cpu,
            "peak_rss_bytes": max(phases.values()), "phase_peak_rss_bytes": phases,
            "rss_after_load_bytes": rss_after_load, "memory": pipe.memory.to_dict(),
            "image_sha256": __import__("hashlib").sha256(result.images.tobytes()).hexdigest()}


def child_diffusers(folder: str, calls: int, threads: int, dtype: str = "float32") -> dict:
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    dt = getattr(torch, dtype)

    def load():
        p = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=dt, safety_checker=None)
        p.scheduler = DDIMScheduler.from_config(p.scheduler.config)
        p.set_progress_bar_config(disable=True)
        return p

    pipe, load_wall, load_cpu = _timed(load)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        sample = torch.randn((2, 4, SIZE // 8, SIZE // 8), generator=gen).to(dt)
        ctx = torch.randn((2, 77, 768), generator=gen).to(dt)
        t = torch.tensor([500, 500])
        _, warm_wall, _ = _timed(lambda: pipe.unet(sample, t, ctx))
        step_wall, step_cpu = [], []
        for _ in range(calls):
            _, w, c = _timed(lambda: pipe.unet(sample, t, ctx))
            step_wall.append(w)
            step_cpu.append(c)
        def image():
            return pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
                        generator=torch.Generator().manual_seed(0), output_type="np")

        _, e2e_wall, e2e_cpu = _timed(image)
        _, e2e2_wall, e2e2_cpu = _timed(image)
    return {"load_wall_s": load_wall, "load_cpu_s": load_cpu, "warmup_call_wall_s": warm_wall,
            "step_wall_s": step_wall, "step_cpu_s": step_cpu, "e2e_wall_s": e2e_wall, "e2e_cpu_s": e2e_cpu,
            "e2e_second_wall_s": e2e2_wall, "e2e_second_cpu_s": e2e2_cpu,
            "peak_rss_bytes": peak_rss_bytes()}


def run_child(kind: str, folder: str, calls: int, threads: int, python: str | None = None) -> dict:
    cmd = [python or sys.executable, __file__, "--child", kind, folder, "--calls", str(calls), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **thread_env(threads)}, timeout=3000)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return {"error": tail}
    return json.loads(lines[-1])


def peer_python(backend: str) -> Path:
    env = os.environ.get(f"ONNXDIFFUSION_{backend.upper()}_PYTHON")
    return Path(env) if env else ROOT / PEER_VENVS[backend] / "bin" / "python"


def run_peer(backend: str, mode: str, source: str, cache: Path, threads: int, timeout: float = 3600) -> dict:
    """One fresh peer worker: load (converting into `cache` on first use), one image, its VmHWM, quit."""
    import numpy as np

    cache.mkdir(parents=True, exist_ok=True)
    (cache / "calib_prompts.json").write_text(json.dumps(CALIB_PROMPTS))
    latents = cache / "latents.npy"
    np.save(latents, np.random.default_rng(0).standard_normal((1, 4, SIZE // 8, SIZE // 8), dtype=np.float32))
    log_path = cache / f"{backend}-{mode}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(thread_env(threads), TQDM_DISABLE="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [str(peer_python(backend)), str(PEER_WORKER), "--backend", backend, "--mode", mode,
           "--folder", str(Path(source).absolute()), "--cache", str(cache.absolute()), "--threads", str(threads),
           "--height", str(SIZE), "--width", str(SIZE), "--calib-prompts", str((cache / "calib_prompts.json").absolute())]
    msgs = [{"cmd": "generate", "prompts": [PROMPT], "latents": str(latents.absolute()),
             "out": str((cache / "images.npy").absolute()), "final_latents": str((cache / "final.npy").absolute()),
             "steps": STEPS, "guidance": GUIDANCE, "height": SIZE, "width": SIZE}, {"cmd": "rss"}, {"cmd": "quit"}]
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, input="".join(json.dumps(m) + "\n" for m in msgs), stdout=subprocess.PIPE,
                                  stderr=log, text=True, env=env, cwd=cache, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"{type(e).__name__}: {e}"[:300]}
    replies = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    errors = [r["message"] for r in replies if r.get("event") == "error"]
    loaded = next((r for r in replies if r.get("event") == "loaded"), None)
    done = next((r for r in replies if r.get("event") == "done"), None)
    rss = next((r for r in replies if r.get("event") == "rss"), None)
    if errors or not (loaded and done and rss):
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return {"error": (errors or [f"peer worker exited ({proc.returncode}): " + (lines[-1] if lines else "")])[0][:300]}
    t = done["timings"]
    return {"load_wall_s": loaded.get("load_s"), "convert_s": loaded.get("convert_s"), "model_bytes": loaded.get("ir_bytes"),
            "versions": loaded.get("versions"), "step_wall_s": t["step_s"], "step_cpu_s": [],
            "e2e_wall_s": t["total_s"], "e2e_cpu_s": t["cpu_s"], "peak_rss_bytes": rss["peak_rss_bytes"],
            **{k: loaded[k] for k in ("inference_precision", "quantized_from", "sampler") if k in loaded}}


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error") if runs else "not run"}
    def med(key):
        xs = [x for r in ok for x in (r.get(key) if isinstance(r.get(key), list) else [r.get(key)]) if x is not None]
        return statistics.median(xs) if xs else None

    out = {"runs": len(ok), "step_wall_s": med("step_wall_s"), "step_cpu_s": med("step_cpu_s"),
           "e2e_wall_s": med("e2e_wall_s"), "e2e_cpu_s": med("e2e_cpu_s"),
           "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok), "load_wall_s": med("load_wall_s"),
           "load_cpu_s": med("load_cpu_s")}
    if all("e2e_second_cpu_s" in r for r in ok):
        out.update(e2e_second_wall_s=med("e2e_second_wall_s"), e2e_second_cpu_s=med("e2e_second_cpu_s"))
    if all("phase_peak_rss_bytes" in r for r in ok):
        out["phase_peak_rss_bytes"] = {k: max(r["phase_peak_rss_bytes"][k] for r in ok) for k in ok[0]["phase_peak_rss_bytes"]}
        out["image_sha256"] = sorted({r["image_sha256"] for r in ok})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], help="NAME=FOLDER (an onnxdiffusion model folder)")
    ap.add_argument("--profile-python", help="the interpreter for variants that name a profile (NAME=FOLDER%%PROFILE), "
                    "e.g. a venv with onnxruntime-openvino in place of onnxruntime")
    ap.add_argument("--diffusers", help="the diffusers folder the ONNX folders were exported from (a peer row)")
    ap.add_argument("--diffusers-rounds", type=int, default=1, help="rounds that include the diffusers row")
    ap.add_argument("--diffusers-bf16", action="store_true",
                    help="also a diffusers eager row in bfloat16 (torch's CPU bf16 path), in the same rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3, help="timed backbone calls per child (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="threads per process (ORT intra-op, torch, OpenMP, peers)")
    ap.add_argument("--peer", action="append", default=[], help="NAME=BACKEND:MODE, e.g. sdcpp-q8_0=sdcpp:q8_0 "
                    "or openvino-int8-hybrid=openvino:int8-hybrid (needs --diffusers and --peer-cache)")
    ap.add_argument("--peer-cache", type=Path, help="folder for the peers' converted models (reused between runs)")
    ap.add_argument("--out", type=Path, help="results JSON (required unless --child)")
    ap.add_argument("--work", help="a folder the paths are under: written as $WORK in the results (no machine paths)")
    args = ap.parse_args()
    if args.child:
        kind, folder = args.child
        if kind == "ours":
            rec = child_ours(folder, args.calls, args.threads)
        else:
            rec = child_diffusers(folder, args.calls, args.threads, "bfloat16" if kind == "diffusers-bf16" else "float32")
        print(json.dumps(rec))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.peer and not (args.diffusers and args.peer_cache):
        ap.error("--peer needs --diffusers (the source folder) and --peer-cache")
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    peers = {name: tuple(spec.split(":", 1)) for name, spec in (p.split("=", 1) for p in args.peer)}
    raw: dict[str, list] = {name: [] for name, _ in variants} | {name: [] for name in peers}
    eager = ["diffusers-eager-fp32"] + (["diffusers-eager-bf16"] if args.diffusers_bf16 else [])
    if args.diffusers and args.diffusers_rounds > 0:  # with --peer only, --diffusers is just the peers' source
        raw.update({name: [] for name in eager})
    log = []
    machine = machine_facts()  # CPU model and ISA flags: results from another machine kind are not comparable
    for r in range(args.rounds):
        order = list(variants) + [(name, args.diffusers) for name in peers]
        order += [(name, args.diffusers) for name in eager] if args.diffusers and r < args.diffusers_rounds else []
        for name, folder in order:
            before = _loadavg()
            if name in peers:
                backend, mode = peers[name]
                rec = run_peer(backend, mode, folder, args.peer_cache / f"{backend}-{mode}", args.threads)
            else:
                kind = {"diffusers-eager-fp32": "diffusers", "diffusers-eager-bf16": "diffusers-bf16"}.get(name, "ours")
                rec = run_child(kind, folder, args.calls, args.threads, args.profile_python if "%" in folder else None)
            rec.update(round=r, loadavg_before=before, loadavg_after=_loadavg())
            raw[name].append(rec)
            log.append(f"round {r} {name}: " + (rec.get("error") or
                       f"step {statistics.median(rec['step_cpu_s'] or [float('nan')]):.2f} s CPU / "
                       f"{statistics.median(rec['step_wall_s']):.2f} s wall, "
                       f"e2e {rec['e2e_cpu_s']:.1f} s CPU / {rec['e2e_wall_s']:.1f} s wall, peak {rec['peak_rss_bytes'] / 1e9:.2f} GB"))
            print(log[-1], file=sys.stderr, flush=True)
            out = {"machine": machine, "settings": {"size": SIZE, "steps": STEPS, "sampler": "ddim", "guidance": GUIDANCE, "batch": 1,
                                "threads": args.threads, "cpus": os.cpu_count(), "calls_per_child": args.calls, "rounds": args.rounds},
                   "folders": dict(variants) | ({name: args.diffusers for name in eager} if args.diffusers else {}),
                   "peers": {name: {"backend": b, "mode": m, "source": args.diffusers, "sampler": PEER_SAMPLERS.get(b)}
                             for name, (b, m) in peers.items()},
                   "summary": {k: summarize(v) for k, v in raw.items()}, "raw": raw, "log": log}
            write_json(args.out, out, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
