#!/usr/bin/env python
"""Peak RSS and time of the int4 step alone at full size: skeleton -> Gemms as MatMuls -> 4-bit MatMulNBits,
weight by weight (quantize/_ort.int4_quantize). Prints one JSON line.

    python experiments/sd15/sd15_int4_step.py $WORK/onnx256
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from onnxdiffusion.bench.rss import peak_rss_bytes
from onnxdiffusion.quantize import _ort, files
from onnxdiffusion.quantize.graphs import quantizable_nodes
from onnxdiffusion.quantize.opgroups import gemms_as_matmuls
from onnxdiffusion.quantize.recipes import prepare_unet
from onnxdiffusion.quantize.static_plan import _infer


def main() -> None:
    unet = prepare_unet(files.load_backbone(Path(sys.argv[1]) / "unet" / "model.onnx"))
    after_load = peak_rss_bytes()
    gemms = [q.name for q in quantizable_nodes(unet, ("Gemm",))]
    base, rewritten = gemms_as_matmuls(unet, gemms)
    base = _infer(base)
    names = [q.name for q in quantizable_nodes(base, ("MatMul",)) if q.weight_size >= 32]
    before = peak_rss_bytes()
    t0 = time.time()
    out = _ort.int4_quantize(base, names, 32, True, 0, 4)
    print(json.dumps({"skeleton": files.data_dir(out) is not None, "matmuls": len(names), "gemms_rewritten": len(rewritten),
                      "int4_seconds": round(time.time() - t0, 1), "peak_rss_after_load_bytes": after_load,
                      "peak_rss_before_int4_bytes": before, "peak_rss_bytes": peak_rss_bytes(),
                      "inline_bytes": files.tensor_bytes(out, inline=True),
                      "external_bytes_left": files.tensor_bytes(out) - files.tensor_bytes(out, inline=True)}))


if __name__ == "__main__":
    main()
