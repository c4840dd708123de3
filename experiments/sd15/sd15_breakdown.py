#!/usr/bin/env python
"""Where the end-to-end time goes at full size: text encoding (with lean mode's reload), each backbone
step, guidance and copies, the sampler update, VAE decoding, the rest (issue 16).

Each variant runs in a fresh child process (never two at once), ONE thread, as experiments/sd15/sd15_int8_measure.py
does: load, one warm-up backbone call plus `--calls` (the state sd15_int8_measure's end-to-end figure is
taken in), then two 256x256 images (DDIM 10 steps, guidance 7.5, batch 1): the first after load (cold text
encoder and VAE decoder sessions: their first run sizes ORT's arena) and a second one (steady state, as a
server sees it). Every part is timed from inside the pipeline, wall and CPU (CLOCK_PROCESS_CPUTIME_ID:
all threads of the process):

- text_encode: Pipeline.conditioning (tokenize + prompt and negative prompt; with `--memory lean` it
  includes loading the text encoder session again: `text_encoder_load`, reported beside it);
- backbone_run: the backbone session's run_with_iobinding, per step;
- guidance_copies: the guided model function minus its session run (batch copies, CFG combine);
- sampler_update: the sampling loop minus the model function (the table's multiply-adds);
- vae_decode_run: the VAE decoder session's runs; decode_post: the rest of Pipeline.decode (clip, uint8);
- other: end to end minus all of the above (option checks, initial latents, result assembly).

    python experiments/sd15/sd15_breakdown.py --variant int8-static-ext-lean=$WORK/int8-static-ext@lean \\
        --variant fp32-ext-lean=$WORK/onnx256-ext@lean --rounds 2 --work $WORK --out bench/report_sd15/breakdown_threads1.json

`--size 512`: the images at 512x512 (peak RSS per image: VmHWM reset before each), e.g. with and without
`@lean,vae_tile=256` (runtime/vae_tiling.py).

`--variant NAME=FOLDER@MEMORY` as in sd15_int8_measure.py (MEMORY: runtime/memory.py's settings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from onnxdiffusion.folder.artifacts import write_json

SIZE, STEPS, GUIDANCE, PROMPT = 256, 10, 7.5, "a photo of an astronaut riding a horse"
PARTS = ("text_encode", "text_encoder_load", "backbone_run", "guidance_copies", "sampler_update", "vae_decode_run",
         "decode_post", "other")


class Clock:
    """Wall and CPU seconds per key; `span` nests (the caller subtracts inner spans where it wants)."""

    def __init__(self):
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)

    def timed(self, key, fn, *a, **k):
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            self.wall[key].append(time.perf_counter() - w)
            self.cpu[key].append(time.process_time() - c)

    def total(self, key: str, cpu: bool = False) -> float:
        return sum((self.cpu if cpu else self.wall).get(key, []))


def _instrument(pipe, clock: Clock) -> None:
    """Wrap the pipeline's stages in place (this process only)."""
    import onnxdiffusion.runtime.pipeline as P
    from onnxdiffusion.runtime import backbone as B

    conditioning = pipe.conditioning
    pipe.conditioning = lambda *a, **k: clock.timed("text_encode", conditioning, *a, **k)
    for holder in pipe.text_sessions.values():
        make = holder._make
        holder._make = lambda make=make: clock.timed("text_encoder_load", make)
    decode = pipe.decode
    pipe.decode = lambda *a, **k: clock.timed("decode", decode, *a, **k)

    class TimedSession:  # the VAE decoder session, its runs timed
        def __init__(self, inner):
            self._inner = inner

        def run(self, *a, **k):
            return clock.timed("vae_decode_run", self._inner.run, *a, **k)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    pipe.vae_decoder = TimedSession(pipe.vae_decoder)
    call = B.GuidedBackbone.__call__

    def guided(self, x, t):
        if not getattr(self, "_timed", False):
            run = self.session.run_with_iobinding
            self.session = type("S", (), {"run_with_iobinding": lambda _s, b: clock.timed("backbone_run", run, b)})()
            self._timed = True
        return clock.timed("model_fn", call, self, x, t)

    B.GuidedBackbone.__call__ = guided
    iter_sample = P.iter_sample

    def timed_iter(*a, **k):
        gen = iter_sample(*a, **k)
        while True:
            try:
                item = clock.timed("loop", next, gen)
            except StopIteration:
                return
            yield item

    P.iter_sample = timed_iter


def _parts(clock: Clock, e2e_wall: float, e2e_cpu: float) -> dict:
    out = {}
    for cpu in (False, True):
        t = lambda k: clock.total(k, cpu)  # noqa: E731
        p = {"text_encode": t("text_encode"), "text_encoder_load": t("text_encoder_load"),
             "backbone_run": t("backbone_run"), "guidance_copies": t("model_fn") - t("backbone_run"),
             "sampler_update": t("loop") - t("model_fn"), "vae_decode_run": t("vae_decode_run"),
             "decode_post": t("decode") - t("vae_decode_run")}
        total = e2e_cpu if cpu else e2e_wall
        p["other"] = total - p["text_encode"] - t("loop") - t("decode")
        p["end_to_end"] = total
        p["backbone_steps"] = list((clock.cpu if cpu else clock.wall)["backbone_run"])
        out["cpu" if cpu else "wall"] = p
    return out


def child(folder: str, calls: int, threads: int, size: int = SIZE) -> dict:
    folder, _, memory = folder.partition("@")
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.bench.rss import peak_rss_bytes, reset_peak_rss
    from onnxdiffusion.families import get_family
    from onnxdiffusion.quantize.report import component_feed
    from onnxdiffusion.runtime import Pipeline

    w, c = time.perf_counter(), time.process_time()
    pipe = Pipeline.from_folder(folder, provider="cpu", threads=threads, memory=memory or None)
    load = {"wall": time.perf_counter() - w, "cpu": time.process_time() - c}
    manifest = read_manifest(Path(folder))
    feed = component_feed(get_family(manifest.get("family")).backbone, manifest)
    for _ in range(1 + calls):
        pipe.backbone.run(None, feed)
    _instrument(pipe, _Proxy())
    images, peaks = [], []
    before = peak_rss_bytes()
    for _ in range(2):
        clock = Clock()
        _CURRENT[:] = [clock]
        reset_peak_rss()
        w, c = time.perf_counter(), time.process_time()
        result = pipe([PROMPT], steps=STEPS, sampler="ddim", guidance=GUIDANCE, seed=0, height=size, width=size)
        images.append(_parts(clock, time.perf_counter() - w, time.process_time() - c))
        peaks.append(peak_rss_bytes())
    return {"load": load, "first_image": images[0], "second_image": images[1],
            "peak_rss_bytes": max(before, *peaks), "image_peak_rss_bytes": peaks, "size": size,
            "memory": pipe.memory.to_dict(),
            "image_sha256": __import__("hashlib").sha256(result.images.tobytes()).hexdigest()}


_CURRENT: list[Clock] = []  # the clock of the image being made


class _Proxy(Clock):
    """The clock the wrappers are installed with (once): forwards to the current image's."""

    def timed(self, key, fn, *a, **k):
        return _CURRENT[0].timed(key, fn, *a, **k)


def run_child(folder: str, calls: int, threads: int, size: int = SIZE) -> dict:
    n = str(threads)
    env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--child", folder, "--calls", str(calls), "--threads", n, "--size", str(size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error") if runs else "not run"}
    out = {"runs": len(ok), "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
           "image_peak_rss_bytes": [max(r["image_peak_rss_bytes"][i] for r in ok) for i in range(2)],
           "image_sha256": sorted({r["image_sha256"] for r in ok})}
    for which in ("first_image", "second_image"):
        out[which] = {}
        for clock in ("wall", "cpu"):
            parts = {k: round(statistics.median(r[which][clock][k] for r in ok), 4) for k in (*PARTS, "end_to_end")}
            steps = [s for r in ok for s in r[which][clock]["backbone_steps"]]
            parts["backbone_step_median"] = round(statistics.median(steps), 4)
            out[which][clock] = parts
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], help="NAME=FOLDER[@MEMORY]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=SIZE, help="image side (the warm-up backbone calls stay at the folder's default)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", help="written as $WORK in the results (no machine paths)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.calls, args.threads, args.size)))
        return 0
    if args.out is None or not args.variant:
        ap.error("--out and at least one --variant are required")
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    raw: dict[str, list] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, folder in variants:
            load = float(Path("/proc/loadavg").read_text().split()[0])
            rec = run_child(folder, args.calls, args.threads, args.size)
            rec.update(round=r, loadavg_before=load)
            raw[name].append(rec)
            msg = rec.get("error") or " ".join(f"{k} {rec['first_image']['wall'][k]:.2f}" for k in
                                               ("end_to_end", "text_encode", "backbone_run", "vae_decode_run"))
            print(f"round {r} {name}: {msg}", file=sys.stderr, flush=True)
            out = {"settings": {"size": args.size, "steps": STEPS, "sampler": "ddim", "guidance": GUIDANCE, "batch": 1,
                                "threads": args.threads, "calls_before_images": 1 + args.calls, "rounds": args.rounds},
                   "folders": dict(variants), "summary": {k: summarize(v) for k, v in raw.items()}, "raw": raw}
            write_json(args.out, out, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
