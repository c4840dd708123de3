"""What a bench run settles before any model runs: its options resolved against the model's own defaults,
the output folder checked, the machine described; plus the progress bar and memory release it uses."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..folder.manifest import Manifest
from .arch import ARCHES

# BenchOptions (core.py) is what _resolve takes and returns; not imported here: core imports this module


def _check_out(out: Path, create: bool = True) -> Path:
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise UserError(f"output directory is a file: {out}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"output directory's parent is a file: {parent}")
            break
    if not create:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {out}: {e.strerror}") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output directory is not writable: {out}")
    return out


def recommended(manifest: Manifest) -> dict:
    """The model's own sampler, steps and guidance (its manifest's `recommended`, checked on read), each present
    or absent."""
    r = manifest.recommended
    out = {}
    if r.sampler is not None:
        out["sampler"] = r.sampler
    if r.steps is not None:
        out["steps"] = r.steps
    if r.guidance is not None:
        out["guidance"] = float(r.guidance)
    return out


def _resolve(options, rec: dict | None = None):
    """Defaults filled in: --arch's, else the model's recommended steps (`rec`, see recommended()), else 20."""
    if options.arch is not None and options.arch not in ARCHES:
        raise UserError(f"unknown --arch {options.arch!r}; choose from {', '.join(ARCHES)}")
    full = options.arch is not None
    steps = options.steps if options.steps is not None else (ARCHES[options.arch].steps if full else (rec or {}).get("steps", 20))
    repeats = options.repeats if options.repeats is not None else (3 if options.isolate else 5)
    fast = options.fast_steps if options.fast_steps is not None else max(1, steps // 2)
    prompts = options.prompts if options.prompts is not None else (0 if full else 16)
    for name, v, lo in (("steps", steps, 1), ("fast-steps", fast, 1), ("repeats", repeats, 1),
                        ("batch", options.batch, 1), ("prompts", prompts, 0)):
        if v < lo:
            raise UserError(f"--{name} must be >= {lo}, got {v}")
    if options.rss not in ("subprocess", "off"):
        raise UserError(f"--rss must be subprocess or off, got {options.rss!r}")
    if options.guidance is not None and (not math.isfinite(options.guidance) or options.guidance < 0):
        raise UserError(f"--guidance must be >= 0, got {options.guidance}")
    if options.sampler is not None:
        from ..samplers.tables import SAMPLERS

        if options.sampler not in SAMPLERS:
            raise UserError(f"unknown --sampler {options.sampler!r}; choose from {', '.join(SAMPLERS)}")
    if options.threads is not None and options.threads < 1:
        raise UserError(f"--threads must be >= 1, got {options.threads}")
    size = options.size if options.size is not None else (ARCHES[options.arch].size if full else None)
    decoder = options.decoder if options.decoder is not None else (ARCHES[options.arch].decoder if full else None)
    if decoder not in (None, "full", "tiny"):
        raise UserError(f"--decoder must be full or tiny, got {decoder!r}")
    if options.memory is not None:
        from ..runtime.memory import memory_options

        memory_options(options.memory)  # a bad --memory fails here, before anything runs
    return replace(options, steps=steps, fast_steps=fast, prompts=prompts, size=size, repeats=repeats,
                   decoder=None if decoder == "full" else decoder)


def _default_guidance(source: Path | None, rec: dict | None = None) -> float:
    """The model's recommended guidance (manifest), else the one it was evaluated with (eval.json beside its
    diffusers folder), else 4.0."""
    if rec and "guidance" in rec:
        return rec["guidance"]
    if source is not None:
        try:
            g = json.loads((Path(source) / "eval.json").read_text())["options"]["guidance"]
            if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                return float(g)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return 4.0


def _release_memory() -> None:
    """Give freed model memory back to the OS before the memory probes start their own copies."""
    from ..onnxio import release_memory

    release_memory()


def _loadavg() -> list[str] | None:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def _is_folder_name(name: str) -> bool:
    """A --variants entry that is a path to a model folder rather than a variant name."""
    return ("/" in name or name.startswith(".")) and Path(name).is_dir()


ISA_FLAGS = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16"}


def machine_info() -> dict:
    import re

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        info["cpu"] = m.group(1).strip() if m else None
        m = re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        # the ISA extensions the int8/bf16 kernels pick between (a VNNI-only and an AMX CPU give other ratios)
        info["cpu_isa"] = sorted(f for f in (m.group(1).split() if m else []) if f in ISA_FLAGS)
        m = re.search(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text())
        info["mem_total_bytes"] = int(m.group(1)) * 1024 if m else None
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    info["numpy"] = np.__version__
    from .machine import machine_facts

    info["cpu_isa"] = machine_facts()["cpu"]  # the ISA flags that decide the int8/bf16 kernels (AMX, VNNI)
    return info


class _Progress:
    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="run", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)

    def step(self, what: str, n: int = 1) -> None:
        self.bar.set_postfix_str(what[:60], refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
