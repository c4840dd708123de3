"""The bottom layer for ONNX files and sessions, shared by runtime, quantize, loops and bench.

files.py: models past protobuf's 2 GB limit (skeletons, external data), saving, ModelProto copies (copy).
session.py: the one ONNX Runtime session factory for in-memory models and files.
Nothing here imports from the rest of onnxdiffusion except errors and manifest (path confinement).
"""

from __future__ import annotations

import gc


def release_memory() -> None:
    """Collect, and hand freed heap back to the OS (glibc), so the next multi-GB allocation does not stack on it."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass



class HeapFrozen:
    """Collections skip the objects alive when the block starts (and at each `settle`).

    A full collection walks every tracked object: once torch, diffusers and transformers are imported that is
    ~400 k objects, 0.2 s a `release_memory` (more in a bigger process), which an export pays twice per component
    whatever the component's size. Objects created since (models, the exporter's graphs) are collected as before;
    everything is unfrozen at the end, so a cycle among frozen objects that died meanwhile is collected later
    (unless the process froze objects itself before the block: its policy then stands, nothing is unfrozen)."""

    def __enter__(self) -> "HeapFrozen":
        self._owner = gc.get_freeze_count() == 0
        self.settle()
        return self

    def settle(self) -> None:
        """Collect, then freeze the survivors: call only where nothing that should die soon is still referenced
        (between two source models, say: the modules a model's loading imported stay frozen from then on)."""
        release_memory()
        gc.freeze()

    def __exit__(self, *exc) -> None:
        if self._owner:
            gc.unfreeze()
