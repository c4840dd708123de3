#!/usr/bin/env python
"""Peak RSS of `export MODEL.gguf --base DIR` (issue 43, part 1-2) beside the fp32 folder export, on a full-width
random backbone (src/onnxdiffusion/bench/arch/fullwidth.py; depth reduced).

    python -m onnxdiffusion.bench.arch.fullwidth build qwenimage W/qwenimage-src --profile memory --depth 3
    python experiments/families/gguf_memory.py convert W/qwenimage-src Q8_0 W/q8_0.gguf   # the backbone as GGUF
    python experiments/families/gguf_memory.py gguf W/q8_0.gguf W/qwenimage-src W/out     # measured in a child
    python experiments/families/gguf_memory.py fp32 W/qwenimage-src W/out

Each measurement runs in a fresh process and prints one JSON line: peak RSS (VmHWM), its anonymous and
file-backed parts at the peak phase (RssAnon / RssFile of /proc/self/status), the phases (export_memory.py's Meter),
the backbone's fp32 bytes (4 x its parameter count) and the exported backbone's bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _status() -> dict:
    """VmHWM, VmRSS, RssAnon, RssFile of this process in bytes (those /proc/self/status has)."""
    from onnxdiffusion.bench.rss import status_bytes

    return {k: v for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile") if (v := status_bytes(k)) is not None}


def child(kind: str, args: list[str]) -> dict:
    import onnx
    import onnxruntime
    import torch

    import onnxdiffusion.export.pipeline as pipeline_mod
    import onnxdiffusion.export.validate as validate_mod
    from export_memory import Meter
    from onnxdiffusion.export import ExportOptions

    meter = Meter()
    anon_peak = {"RssAnon": 0}
    orig_mark = meter.mark

    def mark(label):  # RssAnon at each boundary: the anonymous part (file-backed pages are the page cache's)
        s = _status()
        anon_peak["RssAnon"] = max(anon_peak["RssAnon"], s.get("RssAnon", 0))
        orig_mark(label)

    meter.mark = mark
    meter.wrap(pipeline_mod, "_load_source", "load", "attention fusion, dummy inputs")
    meter.wrap(validate_mod, "_outputs", "PyTorch reference outputs", "between references")
    meter.wrap(torch.onnx, "export", "torch.onnx.export", "release torch module")
    meter.wrap(validate_mod, "consolidate", "external data consolidate", "between")
    meter.wrap(onnx.checker, "check_model", "onnx checker", "between")
    meter.wrap(onnxruntime, "InferenceSession", "ORT session create", "ORT validation runs")
    meter.mark("setup")
    t0 = time.time()
    if kind == "gguf":
        from onnxdiffusion.export.gguf import export_gguf

        gguf_path, base, out = map(Path, args)
        m = export_gguf(gguf_path, out, ExportOptions(components=("transformer",), overwrite=True), base=base,
                        progress=False)
    else:
        from onnxdiffusion.export.pipeline import export_pipeline

        base, out = map(Path, args)
        m = export_pipeline(base, out, ExportOptions(components=("transformer",), overwrite=True), progress=False)
    seconds = time.time() - t0
    meter.mark("end")
    entry = m.to_dict()["components"]["transformer"]
    from onnxdiffusion.bench.arch.fullwidth import count_params

    desc = json.loads((base / "fullwidth.json").read_text())
    params = count_params(desc["arch"], desc["backbone_depth"])
    return {"kind": kind, "file": args[0] if kind == "gguf" else None, "arch": desc["arch"],
            "depth": desc["backbone_depth"], "params": params, "fp32_bytes": 4 * params,
            "component_bytes": entry["bytes"], "precision": entry["precision"], "peak_rss_bytes": meter.peak,
            "peak_over_fp32": round(meter.peak / (4 * params), 3), "anon_rss_max_at_marks_bytes": anon_peak["RssAnon"],
            "export_s": round(seconds, 1), "validation": entry.get("validation"),
            "phases": [{"phase": s["phase"], "peak_gib": round(s["peak_rss_bytes"] / 2**30, 2)} for s in meter.segments]}


def main() -> None:
    verb, *args = sys.argv[1:]
    if verb == "convert":
        from onnxdiffusion.export.gguf_writer import backbone_as_gguf

        # the backbone's safetensors as a GGUF file the way ComfyUI-GGUF writes one, tensor by tensor
        backbone_as_gguf(Path(args[0]), args[1], Path(args[2]))
    elif verb == "--child":
        print(json.dumps(child(args[0], args[1:])))
    elif verb in ("gguf", "fp32"):
        proc = subprocess.run([sys.executable, __file__, "--child", verb, *args], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        print(proc.stdout.strip().splitlines()[-1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
