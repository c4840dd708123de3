"""Running candidate backbones: sessions from ModelProtos, output error on calibration data,
image PSNR on probe prompts, latency, and ORT's optimized (fused) graph."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from ..evaluate.metrics import psnr
from ..onnxio.session import (  # noqa: F401 - the one session factory (onnxio), by the names importers use
    FLOAT8_TYPES, INT8_DISABLED_OPTIMIZERS, disabled_for, ort_optimized, session,
)
from ..onnxio.session import tool_options as session_options  # noqa: F401
from . import files

if TYPE_CHECKING:  # type hints only: calibration imports this module (session) at run time
    from .calibration import CalibrationSet


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    err = float(np.mean((ref.astype(np.float64) - got.astype(np.float64)) ** 2))
    sig = float(np.mean(ref.astype(np.float64) ** 2))
    return math.inf if err == 0 else 10.0 * math.log10(sig / err)


def backbone_outputs(model, calib: CalibrationSet, steps: Sequence[int], threads: int = 1, chunk: int = 64) -> np.ndarray:
    sess = model if isinstance(model, ort.InferenceSession) else session(model, threads)
    out = np.empty((len(steps), *calib.samples.shape[1:]), np.float32)
    for j, s in enumerate(steps):
        for start in range(0, calib.rows, chunk):
            rows = slice(start, start + chunk)
            out[j, rows] = sess.run(["out_sample"], calib.feed(s, rows))[0]
    return out


class ImageProbe:
    """fp32 reference images for a few prompt-seed pairs; PSNR of any candidate backbone against them."""

    def __init__(self, pipe, prompts: list[str], seed: int, steps: int, sampler: str, guidance: float, threads: int = 1):
        self.pipe = pipe
        self.prompts = prompts
        self.seed = seed
        self.kwargs = dict(steps=steps, sampler=sampler, guidance=guidance)
        self.threads = threads
        self.reference = self.images(pipe.backbone)

    def images(self, backbone_session) -> np.ndarray:
        from ..evaluate.run import item_latents

        shape = self.pipe.latent_shape_for(1)[1:]
        latents = item_latents(shape, [self.seed + i for i in range(len(self.prompts))])
        saved = self.pipe.backbone
        self.pipe.backbone = backbone_session
        try:
            from ..runtime.references import probe_feeds

            return self.pipe(self.prompts, batch=len(self.prompts), latents=latents, **self.kwargs,
                             **probe_feeds(self.pipe, light=True)).images  # an editing model edits the probe picture
        finally:
            self.pipe.backbone = saved

    def psnr(self, model) -> float:
        sess = model if isinstance(model, ort.InferenceSession) else session(model, self.threads)
        got = self.images(sess)
        return float(np.mean([psnr(a, b) for a, b in zip(got, self.reference)]))


def time_sessions(sessions: dict, feed: dict, runs: int, warmup: int = 3, clock: str = "wall") -> dict[str, dict]:
    """Median call time per session; calls interleaved so background load hits all alike.

    `clock="cpu"`: the calling thread's CPU time, for one-thread sessions (ORT then runs the call on the
    calling thread) whose times choose what is built: wall time on a loaded machine is mostly waiting
    for a core (measured on a 2-vCPU host with 4 busy processes: a with/without ratio of 1.15 read as
    1.05-1.55 by wall medians and minima, 1.13-1.16 by CPU time), so a choice by wall time flips with the
    load and the same build writes other bytes."""
    tick = {"wall": time.perf_counter, "cpu": time.thread_time}[clock]
    for s in sessions.values():
        for _ in range(warmup):
            s.run(None, feed)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(runs):
        for k, s in sessions.items():
            t0 = tick()
            s.run(None, feed)
            times[k].append(tick() - t0)
    return {k: {"median_ms": float(np.median(v) * 1e3), "min_ms": float(np.min(v) * 1e3), "runs": runs}
            for k, v in times.items()}


def decision_clock(threads: int | None) -> str:
    """The clock for timings that choose what is built: CPU time where ORT runs a call on the calling
    thread (one intra-op thread: quantize's default), wall time where its pool spreads the call."""
    return "cpu" if threads == 1 else "wall"


def latency(models: dict[str, onnx.ModelProto | str | Path], feed: dict, threads: int, runs: int,
            provider: str = "cpu", warmup: int = 3) -> dict[str, dict]:
    """Median backbone call time per model, each in a session built as the pipeline builds it."""
    return time_sessions({k: session(m, threads, provider) for k, m in models.items()}, feed, runs, warmup)


_RSS_SNIPPET = r"""
import sys, json, numpy as np, onnxruntime as ort
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
feed = {k: np.load(v) for k, v in json.loads(sys.argv[2]).items()}
o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.log_severity_level = 3
before = rss()
s = ort.InferenceSession(sys.argv[1], o, providers=["CPUExecutionProvider"], disabled_optimizers=json.loads(sys.argv[3]))
loaded = rss()
s.run(None, feed)
print(json.dumps({"session_mb": (loaded - before) / 2**20, "after_run_mb": (rss() - before) / 2**20}))
"""


def memory_mb(path: str | Path, feed: dict[str, np.ndarray]) -> dict | None:
    """Resident memory a fresh process gains by loading the model, and after one call (Linux only)."""
    import json
    import subprocess
    import sys

    if not Path("/proc/self/statm").exists():
        return None
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-mem-") as tmp:
        files = {}
        for k, v in feed.items():
            files[k] = str(Path(tmp) / f"{k}.npy")
            np.save(files[k], v)
        disabled = list(disabled_for(path))
        proc = subprocess.run([sys.executable, "-c", _RSS_SNIPPET, str(path), json.dumps(files), json.dumps(disabled)],
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None
    return {k: round(v, 1) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
