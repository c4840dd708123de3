"""What an ORT_ENABLE_ALL-optimized graph is tied to: the ONNX Runtime version and the CPU's vector width.

ORT's NCHWc layout pass blocks convolution channels by the width MLAS picks for this CPU (16 floats
with AVX-512, 8 with AVX2, none without), and the contrib ops it inlines belong to that ORT release.
A graph saved after that pass (`compile-loop`'s default, cpu_tuned) is recorded with this target, and a
pipeline refuses to run it where the target differs, instead of failing or computing with the wrong
blocking deep inside ONNX Runtime.
"""

from __future__ import annotations

import platform
from pathlib import Path


def vector_isa() -> str:
    """avx512 | avx2 | <machine> (the MLAS kernel family that decides NCHWc blocking)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return machine
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        if "avx512f" in flags:
            return "avx512"
        if "avx2" in flags and "fma" in flags:
            return "avx2"
    return machine


def cpu_target() -> dict:
    import onnxruntime

    return {"onnxruntime": onnxruntime.__version__, "isa": vector_isa()}


def target_mismatch(recorded: dict | None) -> str | None:
    """None when a graph tuned for `recorded` may run here, else what differs (one phrase)."""
    if not recorded:
        return None
    here = cpu_target()
    diff = [f"{k} {recorded.get(k)} (here {here[k]})" for k in here if recorded.get(k) != here[k]]
    return ", ".join(diff) or None
