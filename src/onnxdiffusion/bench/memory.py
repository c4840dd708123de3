"""Peak resident memory per variant, measured in a fresh process.

The bench keeps every variant loaded in one process (so repeats can interleave), which makes an
in-process peak meaningless per variant. So each variant's peak RSS comes from a child process that
imports what the variant needs, loads it and generates one batch-1 image, and reports VmHWM (the
kernel's high-water mark of its resident set) plus its RSS after imports (the baseline). A peer
worker reports the same numbers about itself after its first call.

    python -m onnxdiffusion.bench.memory - < SPEC.json   # prints one JSON line (the spec, latents included, on stdin:
                                                         # a 256x256 flow model's latents pass the argument-size limit)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

METHOD = ("VmHWM of a fresh child process that imports the variant's libraries, loads it and generates one "
          "batch-1 image, per phase (load; first image), reset between them (peers: the worker's own VmHWM per "
          "phase: load, first call, timed repeats; a one-off conversion apart)")


def probe(spec: dict, python: str | None = None, timeout: float = 1800, env: dict | None = None) -> dict:
    """Run this module in a child process for one variant spec; returns its JSON record or {'error': ...}."""
    cmd = [python or sys.executable, "-m", "onnxdiffusion.bench.memory", "-"]
    try:
        proc = subprocess.run(cmd, input=json.dumps(spec), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"memory probe timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return {"error": f"memory probe failed: {tail}"}
    return json.loads(lines[-1])


def _child(spec_json: str) -> int:
    import numpy as np

    from .runners import Job, make_runner
    from .variants import VariantSpec

    d = json.loads(spec_json)
    job = d.pop("job")
    threads = d.pop("threads", None)
    d["folder"] = Path(d["folder"]) if d.get("folder") else None
    d["peer_python"] = Path(d["peer_python"]) if d.get("peer_python") else None
    spec = VariantSpec(**d)
    if spec.kind == "torch":  # the import is part of what this variant costs
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    baseline = current_rss_bytes()
    runner = make_runner(spec, threads=threads, height=job["height"], width=job["width"])
    info = runner.load()
    after_load = current_rss_bytes()
    phases = {"load": peak_rss_bytes()}
    reset_peak_rss()
    latents = np.asarray(job["latents"], dtype=np.float32).reshape(job["shape"])
    runner.generate(Job([job["prompt"]], latents, job["guidance"], job["height"], job["width"]))
    phases["first"] = peak_rss_bytes()
    out = {"peak_rss_bytes": max(phases.values()), "phase_peak_rss_bytes": phases, "baseline_rss_bytes": baseline,
           "after_load_rss_bytes": after_load, "load_s": info.get("load_s"), "pid": os.getpid()}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.stdin.read() if sys.argv[1:] == ["-"] else sys.argv[1]))
