"""`bench --isolate`: every variant measured in fresh processes, rounds interleaved, CPU time and peak RSS per phase.

The method of the committed full-size figures (experiments/sd15-int8/sd15_int8_measure.py): never two models in
one process, never two measured processes at once. Each round runs every variant once, in turn (the order
rotated every round: this machine's speed drifts), each in a child process that

  1. loads the variant (wall and CPU seconds; the peak RSS of the load phase),
  2. generates the timed job once (one prompt, batch 1, seed 0): end to end wall and CPU seconds, every
     sampling step's wall and CPU seconds (seen at the step callback: backbone call + sampler update), the
     peak RSS of the image phase (the kernel's high-water mark is reset between the phases),

and reports itself as one JSON line. A peer is its own fresh worker process per round (it times itself and
reports its VmHWM per phase, reset between them as here); its one-off conversion (OpenVINO IR, GGUF) runs
first in a process of its own, cached under the work folder, and its peak is reported apart (`convert`),
never as the peer's peak. Every record counts the backbone calls of its image. CPU time is
user + system of the measuring process, all its threads: with --threads 1 on a shared machine it leaves out
the time other processes held the core, so it is the steadier figure. Medians over rounds are reported, plus
every round's record and the load average before and after it.

    python -m onnxdiffusion.bench.isolate - < SPEC.json   # one child: prints one JSON line
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from .runners import Generation, Job, PeerError, PeerRunner, make_runner
from .setup import _loadavg as loadavg
from .variants import VariantSpec

METHOD = ("fresh process per variant and round (peers: a fresh worker), rounds interleaved; load, then one timed "
          "image; CPU = user+sys of that process; peak RSS = VmHWM per phase (load, image), reset between them; "
          "a peer's one-off conversion in its own process, its peak apart (not the peer's peak)")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def thread_env(threads: int | None) -> dict:
    if not threads:
        return {}
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def _record(gen: Generation, load_wall: float, load_cpu: float, phases: dict) -> dict:
    return {"load_wall_s": load_wall, "load_cpu_s": load_cpu, "e2e_wall_s": gen.total_s, "e2e_cpu_s": gen.cpu_s,
            "step_wall_s": gen.step_s or [], "step_cpu_s": gen.step_cpu_s or [], "sampling_s": gen.sampling_s,
            "text_encoder_s": gen.text_encoder_s, "vae_s": gen.vae_s, "backbone_calls": gen.backbone_calls,
            "peak_rss_bytes": max(v for v in phases.values() if v is not None), "phase_peak_rss_bytes": phases}


def child(spec_json: str) -> dict:
    d = json.loads(spec_json)
    job, threads, memory = d.pop("job"), d.pop("threads", None), d.pop("memory", None)
    images_out, profile = d.pop("images_out", None), d.pop("profile", None)
    d["folder"] = Path(d["folder"]) if d.get("folder") else None
    d["peer_python"] = Path(d["peer_python"]) if d.get("peer_python") else None
    spec = VariantSpec(**d)
    reset_peak_rss()
    w, c = time.perf_counter(), _cpu()
    if spec.kind == "torch":  # the import is part of what loading this variant costs
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    from .runners import _PipelineCache

    runner = make_runner(spec, threads=threads, cache=_PipelineCache(threads, "cpu", profile, memory),
                         height=job["height"], width=job["width"])
    runner.load()
    load_wall, load_cpu = time.perf_counter() - w, _cpu() - c
    phases = {"load": peak_rss_bytes(), "rss_after_load": current_rss_bytes()}
    reset_peak_rss()
    latents = np.asarray(job["latents"], dtype=np.float32).reshape(job["shape"])
    gen = runner.generate(Job([job["prompt"]], latents, job["guidance"], job["height"], job["width"]))
    phases["image"] = peak_rss_bytes()
    if not np.isfinite(gen.images).all():
        raise RuntimeError("the image is not finite")
    if images_out:
        np.save(images_out, gen.images)
    rec = _record(gen, load_wall, load_cpu, {k: v for k, v in phases.items() if k != "rss_after_load"})
    rec.update(rss_after_load_bytes=phases["rss_after_load"], pid=os.getpid())
    return rec


def run_child(spec: VariantSpec, job: Job, threads: int | None, profile: str | None, memory: str | None,
              images_out: Path | None, timeout: float = 3600) -> dict:
    d = spec.to_dict()
    d.update(threads=threads, memory=memory, images_out=str(images_out) if images_out else None,
             job={"prompt": job.prompts[0], "latents": job.latents.ravel().tolist(), "shape": list(job.latents.shape),
                  "guidance": job.guidance, "height": job.height, "width": job.width})
    d.pop("profile", None)
    if profile:
        d["profile"] = profile
    cmd = [sys.executable, "-m", "onnxdiffusion.bench.isolate", "-"]
    try:
        proc = subprocess.run(cmd, input=json.dumps(d), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **thread_env(threads)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return {"error": tail}
    return json.loads(lines[-1])


def run_peer(spec: VariantSpec, job: Job, threads: int | None, work: Path, calib: list[str],
             timeout: float = 3600) -> dict:
    runner = PeerRunner(spec, threads, work / spec.name, work / f"{spec.name}.log", job.height, job.width, calib,
                        timeout)
    try:
        w = time.perf_counter()
        info = runner.load()
        load_wall = time.perf_counter() - w
        phases = {"load": runner.rss().get("peak_rss_bytes")}
        runner.reset_peak()
        gen = runner.generate(job)
        phases["image"] = runner.rss().get("peak_rss_bytes")
    except (PeerError, OSError) as e:
        return {"error": str(e)[:300]}
    finally:
        runner.close()
    rec = _record(gen, info.get("load_s", load_wall), None, phases)
    rec.update(convert_s=info.get("convert_s"), model_bytes=info.get("ir_bytes"), images=gen.images,
               load=info)
    if runner.convert is not None:  # this round converted: its peak apart
        rec["convert"] = runner.convert
    return rec


def _loadavg() -> float | None:
    avg = loadavg()
    return float(avg[0]) if avg else None


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def summarize(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[-1].get("error") if rounds else "not run"}
    out = {"rounds": len(ok)}
    for key in ("load_wall_s", "load_cpu_s", "e2e_wall_s", "e2e_cpu_s"):
        out[key] = _median(r.get(key) for r in ok)
    for key in ("step_wall_s", "step_cpu_s"):  # the median step of every round's steps
        out[key] = _median(x for r in ok for x in r.get(key) or [])
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ok)
    out["phase_peak_rss_bytes"] = {k: max(r["phase_peak_rss_bytes"].get(k) or 0 for r in ok)
                                   for k in ok[0]["phase_peak_rss_bytes"]}
    calls = {r.get("backbone_calls") for r in ok} - {None}
    out["backbone_calls"] = calls.pop() if len(calls) == 1 else (sorted(calls) or None)
    converted = [r["convert"] for r in rounds if r.get("convert")]
    if converted:  # one-off, apart: never in peak_rss_bytes
        out["convert"] = converted[0]
    return out


def generation_of(rec: dict, images) -> Generation:
    """The round as the report's timing columns read it (the images only of the round that kept them)."""
    return Generation(images=images, total_s=rec["e2e_wall_s"], text_encoder_s=rec["text_encoder_s"],
                      sampling_s=rec["sampling_s"], vae_s=rec["vae_s"], step_s=rec["step_wall_s"] or None,
                      cpu_s=rec["e2e_cpu_s"], step_cpu_s=rec["step_cpu_s"] or None,
                      backbone_calls=rec.get("backbone_calls"))


def run_isolated(states, job: Job, rounds: int, threads: int | None, profile: str | None, memory: str | None,
                 scratch: Path, peer_dir: Path, calib: list[str], step) -> None:
    """Fill each state's load / gens / memory / rounds from `rounds` interleaved rounds of fresh processes."""
    scratch.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        k = r % len(states)
        for st in states[k:] + states[:k]:
            before = _loadavg()
            images_out = scratch / f"{st.spec.name}.npy" if r == 0 else None
            if st.spec.kind == "peer":
                rec = run_peer(st.spec, job, threads, peer_dir, calib)
                images = rec.pop("images", None)
                st.load = rec.pop("load", st.load) or st.load
            else:
                rec = run_child(st.spec, job, threads, profile, memory, images_out)
                images = np.load(images_out) if images_out is not None and images_out.is_file() else None
            rec.update(round=r, loadavg_before=before, loadavg_after=_loadavg())
            st.rounds.append(rec)
            if "error" not in rec:
                st.gens.append(generation_of(rec, images))
                if images is not None and st.timing_images is None:
                    st.timing_images = images
                if st.spec.kind != "peer":
                    st.load = {"load_s": rec["load_wall_s"], "load_cpu_s": rec["load_cpu_s"]}
            step(f"round {r + 1}/{rounds} {st.spec.name}: " + (rec.get("error") or _line(rec)))
    for st in states:
        summary = summarize(st.rounds)
        if "error" in summary:
            st.error = f"every isolated round failed: {summary['error']}"
            continue
        st.memory = {"peak_rss_bytes": summary["peak_rss_bytes"], "phase_peak_rss_bytes": summary["phase_peak_rss_bytes"],
                     "method": METHOD}
        if "convert" in summary:
            st.memory["convert"] = summary["convert"]
        st.isolated = summary


def _line(rec: dict) -> str:
    step = _median(rec.get("step_cpu_s") or []) or _median(rec.get("step_wall_s") or [])
    cpu = rec.get("e2e_cpu_s")
    return (f"e2e {rec['e2e_wall_s']:.1f} s wall" + (f" / {cpu:.1f} s CPU" if cpu is not None else "")
            + (f", step {step:.2f} s" if step else "") + f", peak {rec['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    print(json.dumps(child(sys.stdin.read())), flush=True)
