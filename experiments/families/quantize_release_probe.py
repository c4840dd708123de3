#!/usr/bin/env python
"""One klein-size int8-dynamic linear (DynamicQuantizeLinear -> MatMulInteger 3072x27648 uint8 -> Cast -> Mul, the
weight in page-aligned external data) run once under the `bounded` session options (no pre-packing, no arena, no
memory pattern) or with pre-packing: does ORT keep the uint8 weight as file-backed pages? (quantize_release.md)

    cd SCRATCH && python quantize_release_probe.py build && python quantize_release_probe.py noprepack
    python quantize_release_probe.py prepack          # GB in the output: /proc/self/status kB / 1e6
    S=256 T=256 python quantize_release_probe.py backbone WORK/klein-int8d/transformer/model.onnx
                                                      # the whole int8 backbone, two calls at S image + T text tokens
(a watchdog ends the process past 4 GB anonymous: this session's memory share)
"""
import sys, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
K, N, M = 3072, 27648, 1536
def status():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "RssAnon", "RssFile"): d[k] = int(v.split()[0]) / 1e6
    return d


def backbone() -> None:
    import os
    import threading
    import time

    def watch():
        while status()["RssAnon"] < 4.0:
            time.sleep(0.1)
        print("watchdog: over 4 GB anonymous", status(), flush=True)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.enable_cpu_mem_arena = False; o.enable_mem_pattern = False
    o.add_session_config_entry("session.disable_prepacking", "1")
    t = time.time()
    s = ort.InferenceSession(sys.argv[2], o, providers=["CPUExecutionProvider"])
    print("loaded", round(time.time() - t, 1), status(), flush=True)
    S, T = int(os.environ.get("S", 64)), int(os.environ.get("T", 32))
    rng = np.random.default_rng(0)
    feed = {"sample": rng.standard_normal((1, S, 128), dtype=np.float32), "timestep": np.array([0.5], np.float32),
            "encoder_hidden_states": rng.standard_normal((1, T, 7680), dtype=np.float32),
            "img_ids": np.zeros((1, S, 4), np.float32), "reference_latents": np.zeros((1, 0, 128), np.float32),
            "reference_ids": np.zeros((1, 0, 4), np.float32)}
    types = {i.name: i.type for i in s.get_inputs()}
    feed = {k: (v.astype(np.int64) if "int64" in types[k] else v) for k, v in feed.items() if k in types}
    for call in (1, 2):
        t = time.time()
        s.run(None, feed)
        print("call", call, round(time.time() - t, 1), status(), flush=True)


def build() -> None:
    w = np.random.default_rng(0).integers(0, 255, (K, N), dtype=np.uint8)
    W = numpy_helper.from_array(w, "W")
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "W", "xz", "wz"], ["yi"]),
             helper.make_node("Cast", ["yi"], ["yf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["yf", "xs"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
                          [W, numpy_helper.from_array(np.array(128, np.uint8), "wz")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(m, "m.onnx", save_as_external_data=True, location="m.onnx_data", size_threshold=1024)


def run(mode: str) -> None:
    o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.enable_cpu_mem_arena = False; o.enable_mem_pattern = False
    if mode == "noprepack": o.add_session_config_entry("session.disable_prepacking", "1")
    s = ort.InferenceSession("m.onnx", o, providers=["CPUExecutionProvider"])
    print("loaded", status())
    s.run(None, {"x": np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)})
    print("ran", status(), "weight MB", K * N / 1e6)


def main() -> None:
    if sys.argv[1] == "backbone":
        backbone()
    elif sys.argv[1] == "build":
        build()
    else:
        run(sys.argv[1])


if __name__ == "__main__":
    main()
