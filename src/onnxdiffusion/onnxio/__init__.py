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

