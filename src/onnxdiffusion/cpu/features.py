"""The CPU's model name and ISA flags, read in ONE place (tests monkeypatch `cpu_flags`).

`int8_family()` names the integer-GEMM kernels ONNX Runtime's MLAS runs on this CPU:
  amx       amx_int8 + amx_tile (Sapphire Rapids and later): QgemmU8S8KernelAmx, ~2-2.5x VNNI at 1 thread
  vnni      avx512_vnni or avx_vnni: the VNNI u8 x s8 kernels (MlasConvSym, QgemmU8S8 Avx512Vnni)
  portable  anything else (AVX2 without VNNI, ARM, ...)
Linux reports AMX in /proc/cpuinfo only when the kernel lets processes use the tiles (XFD), which is
also what MLAS needs before it takes its AMX path.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the flags that decide which int8 / bf16 kernels run (reported in every results file)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16", "asimddp", "i8mm", "bf16", "sve")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (lowercase, as /proc/cpuinfo spells them; empty where unreadable)."""
    for line in _cpuinfo().splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.split(":", 1)[0].strip().lower() in ("model name", "cpu model", "hardware"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def int8_family(flags: frozenset[str] | None = None) -> str:
    """amx | vnni | portable: which of MLAS's integer GEMM kernels this CPU gets."""
    f = cpu_flags() if flags is None else flags
    if {"amx_int8", "amx_tile"} <= f:
        return "amx"
    if "avx512_vnni" in f or "avx_vnni" in f:
        return "vnni"
    return "portable"


def isa_summary(flags: frozenset[str] | None = None) -> dict:
    """The flags of ISA_FLAGS this CPU has, the int8 family, the core count, the machine."""
    f = cpu_flags() if flags is None else flags
    return {"model": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count(),
            "isa_flags": [x for x in ISA_FLAGS if x in f], "int8_kernels": int8_family(f)}
