"""Why sd/int8-static-schedule wrote two different UNets (175 or 133 quantized nodes): int8-static keeps its
weightless op groups (attention + softmax: 28 + 14 nodes) only if the backbone times >= 3% faster with them, and
that time was wall time. This repeats the choice's own timing (the `with` / `without` QDQ backbones int8-static
builds for the embedded SD model) REPS times and prints the with/without ratio by wall time and by the calling
thread's CPU time, median and minimum of each 15-call round. Run it with the machine quiet, then with busy
processes beside it (e.g. four `python3 -c "while 1: pass"`).

    PYTHONPATH=src python experiments/house/decision_clock.py [REPS]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(reps: int) -> None:
    import tempfile

    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    import behaviour_hashes as bh

    from onnxdiffusion.quantize import runner

    def probe(sessions, feed, runs, warmup=3, clock="wall"):
        for s in sessions.values():
            for _ in range(warmup):
                s.run(None, feed)
        for i in range(reps):
            wall = {k: [] for k in sessions}
            cpu = {k: [] for k in sessions}
            for _ in range(runs):
                for k, s in sessions.items():
                    t0, c0 = time.perf_counter(), time.thread_time()
                    s.run(None, feed)
                    cpu[k].append(time.thread_time() - c0)
                    wall[k].append(time.perf_counter() - t0)

            def ratio(d, fn):
                return fn(d["with"]) / fn(d["without"])

            print(f"round {i}: wall median {ratio(wall, np.median):.3f} min {ratio(wall, np.min):.3f} | "
                  f"cpu median {ratio(cpu, np.median):.3f} min {ratio(cpu, np.min):.3f}", flush=True)
        raise SystemExit(0)

    runner.time_sessions = probe  # the choice's timing is the first call of time_sessions in an int8-static build
    case = next(c for c in bh.CASES if c[0] == "int8-static")
    with tempfile.TemporaryDirectory() as scratch:
        bh.run_case("sd", case, Path(scratch))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
