"""MLAS speed of the LoRA branch's skinny products next to a layer's own (experiments/lora/overhead.md): one
MatMul per ONNX graph, 1 thread, CPU time per run (session overhead included), min over 30 x 50 runs.

    python experiments/lora/micro_gemm.py
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def session(m: int, k: int, n: int, constant: bool):
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])]
    if not constant:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n]))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "W")] if constant else [])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.ones((m, k), np.float32), **({} if constant else {"W": w})}
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]), feeds


def main() -> None:
    print("| M | K | N | weight | us / run | GFLOP/s |\n|---|---|---|---|---|---|")
    for m, k, n, constant in [(512, 128, 128, True), (512, 128, 16, False), (512, 16, 128, False),
                              (512, 128, 48, False), (512, 128, 0, False), (512, 0, 128, False)]:
        s, feeds = session(m, k, n, constant)
        best = min(_time(s, feeds) for _ in range(30))
        print(f"| {m} | {k} | {n} | {'constant' if constant else 'fed'} | {best * 1e6:.1f} | {2 * m * k * n / best / 1e9:.1f} |")


def _time(s, feeds, runs: int = 50) -> float:
    t = time.process_time()
    for _ in range(runs):
        s.run(None, feeds)
    return (time.process_time() - t) / runs


if __name__ == "__main__":
    main()
