"""What an ORT session's creation costs per optimization level (experiments/house/test_time.md, session of 8 Dec):
median CPU ms of 5 creations each, 1 intra-op thread, from the file (the last row: from its bytes).

    python experiments/house/session_cost.py models/shapes-sd-onnx/unet/model.onnx ..."""

import statistics
import sys
import time

import onnxruntime as ort

LEVEL = ort.GraphOptimizationLevel
CASES = [("disable", LEVEL.ORT_DISABLE_ALL, {}), ("basic", LEVEL.ORT_ENABLE_BASIC, {}),
         ("extended", LEVEL.ORT_ENABLE_EXTENDED, {}), ("all", LEVEL.ORT_ENABLE_ALL, {}),
         ("all-noprepack", LEVEL.ORT_ENABLE_ALL, {"session.disable_prepacking": "1"}),
         ("all-bytes", LEVEL.ORT_ENABLE_ALL, {})]


def cpu_of_one(source, level, config: dict) -> float:
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.log_severity_level = 3
    o.graph_optimization_level = level
    for k, v in config.items():
        o.add_session_config_entry(k, v)
    c = time.process_time()
    ort.InferenceSession(source, o, providers=["CPUExecutionProvider"])
    return time.process_time() - c


def main(paths: list[str]) -> None:
    for p in paths:
        data = open(p, "rb").read()
        for name, level, config in CASES:
            ts = [cpu_of_one(data if name.endswith("bytes") else p, level, config) for _ in range(5)]
            print(f"{p.split('/')[-2]:14s} {name:14s} median {statistics.median(ts) * 1000:7.1f} ms  "
                  f"min {min(ts) * 1000:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
