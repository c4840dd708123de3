"""Activations handed back to the system when ONNX Runtime's arena is off.

Without the arena ORT frees each activation after its last use, but glibc's malloc keeps a freed block below its
mmap threshold in the heap, and that threshold rises (up to 32 MB) each time a larger mapped block is freed: the
1-32 MB activations of a full-size backbone then pile up in a heap that is not given back. One FLUX.2 [klein]
int8 step at 512x512 under `--memory bounded` held 7.1 GB anonymous that way, 0.37 GB with the threshold fixed at
1 MiB (experiments/families/quantize_release.md). A fixed threshold maps every such block alone and unmaps it when
freed; small allocations are untouched. It is set for the whole process, and only once a full-size model
(FULL_SIZE bytes of files in its folder) loads that way: a small model's activations do not pile up, and every
mapped block costs its page faults.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD = 1 << 20
FULL_SIZE = 1 << 30
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up: a user's own setting is kept
_lock = threading.Lock()
_state: dict[str, bool] = {}


def full_size(model: Path) -> bool:
    """The model's folder holds FULL_SIZE bytes of files or more (its graph and external data)."""
    try:
        return sum(f.stat().st_size for f in Path(model).parent.iterdir() if f.is_file()) >= FULL_SIZE
    except OSError:
        return False


def hand_back_large_blocks() -> bool:
    """Fix malloc's mmap threshold at THRESHOLD for this process (once). False where it was not set: not glibc, or
    the user set MALLOC_MMAP_THRESHOLD_ themselves."""
    with _lock:
        if "done" not in _state:
            _state["done"] = _set()
        return _state["done"]


def _set() -> bool:
    if ENV in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
