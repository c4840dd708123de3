#!/usr/bin/env python
"""One ONNX Runtime session alone in a fresh process: resident set after loading and after each of
three runs, the high-water mark of each phase (reset between them), and CPU time; 1 thread.

    python experiments/sd15/sd15_component_memory.py $WORK/int8-static/unet/model.onnx unet
    python experiments/sd15/sd15_component_memory.py $WORK/int8-static-ext/unet/model.onnx unet      # external data
    python experiments/sd15/sd15_component_memory.py $WORK/onnx256/text_encoder/model.onnx te --option noprepack
    python experiments/sd15/sd15_component_memory.py $WORK/onnx256/vae_decoder/model.onnx vae256 --option nopattern

Options: noprepack (session.disable_prepacking), noarena, nopattern (enable_mem_pattern off). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import onnxruntime as ort

from onnxdiffusion.bench.rss import reset_peak_rss, status_bytes


def _phase(name: str, fn, out: list):
    reset_peak_rss()
    t = os.times()
    result = fn()
    u = os.times()
    out.append({"phase": name, "rss_gb": round(status_bytes("VmRSS") / 1e9, 3),
                "anon_gb": round(status_bytes("RssAnon") / 1e9, 3), "peak_gb": round(status_bytes("VmHWM") / 1e9, 3), "cpu_s": round(u.user + u.system - t.user - t.system, 2)})
    print(json.dumps(out[-1]), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("feed", choices=("te", "unet", "vae256", "vae512"))
    ap.add_argument("--option", action="append", default=[], choices=("noprepack", "noarena", "nopattern"))
    args = ap.parse_args()
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.log_severity_level = 3
    if "noprepack" in args.option:
        o.add_session_config_entry("session.disable_prepacking", "1")
    o.enable_cpu_mem_arena = "noarena" not in args.option
    o.enable_mem_pattern = "nopattern" not in args.option
    extra = {"disabled_optimizers": ["NchwcTransformer", "NhwcTransformer"]} if args.feed == "unet" else {}
    rows: list = []
    sess = _phase("load", lambda: ort.InferenceSession(args.model, o, providers=["CPUExecutionProvider"], **extra), rows)
    types = {i.name: i.type for i in sess.get_inputs()}
    if args.feed == "te":
        feed = {"input_ids": np.ones((2, 77), np.int32 if "int32" in types["input_ids"] else np.int64)}
    elif args.feed == "unet":
        feed = {"sample": np.zeros((2, 4, 32, 32), np.float32), "encoder_hidden_states": np.zeros((2, 77, 768), np.float32),
                "timestep": np.full((2,), 500, np.float32 if "float" in types["timestep"] else np.int64)}
    else:
        side = int(args.feed[3:]) // 8
        feed = {"latent_sample": np.zeros((1, 4, side, side), np.float32)}
    for i in range(3):
        _phase(f"run{i}", lambda: sess.run(None, feed), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
