#!/usr/bin/env python
"""Is the anonymous memory that grows during one ONNX Runtime call under `--memory bounded` held tensors or glibc's
heap? (issue 43, qwen20b.md). One session made as the run time makes it under `bounded` (no pre-packing, no arena,
no memory pattern), CALLS calls (2); RssAnon sampled every 0.5 s during each call. Run it twice, once as is and once with
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072 (every allocation above 128 KiB its own mapping, given back on
free: glibc's dynamic threshold, which moves blocks of the size last freed onto the brk heap, switched off). If the
growth is gone under the tunable, it was the heap's free lists (memory freed but not returned), not live tensors.

    python experiments/families/heap_ab.py MODEL.onnx [TOKENS] [CALLS]   # a text encoder (input_ids, attention_mask)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    import onnxruntime as ort

    from onnxdiffusion.onnxio.session import session_options
    from onnxdiffusion.runtime.memory import memory_options

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from anon_watch import sample

    path, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    t = time.time()
    sess = ort.InferenceSession(path, sess_options=session_options(2, memory_options("bounded")),
                                providers=["CPUExecutionProvider"])
    out = {"tunables": os.environ.get("GLIBC_TUNABLES", ""), "load_s": round(time.time() - t, 1),
           "anon_after_load": status("RssAnon"), "calls": []}
    ids = np.random.default_rng(0).integers(1, 150000, (1, tokens)).astype(np.int64)
    for _ in range(calls):
        peak, at_peak, stop = [0], [None], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                anon = status("RssAnon")
                if anon > peak[0] * 1.02:  # where it lives at (near) the peak: heap, arenas, one-by-one mappings
                    peak[0], at_peak[0] = anon, sample(os.getpid())
                time.sleep(0.5)
        th = threading.Thread(target=watch)
        th.start()
        t = time.time()
        sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        stop.set()
        th.join()
        kinds = {k: {"anon": v["Anonymous"], "mappings": v["count"]} for k, v in at_peak[0]["kinds"].items()}
        out["calls"].append({"s": round(time.time() - t, 1), "max_rss_anon": peak[0], "rss_anon_after": status("RssAnon"),
                             "at_peak": kinds, "largest_anon_at_peak": at_peak[0]["largest_anon"]})
    out["vmhwm"] = status("VmHWM")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
