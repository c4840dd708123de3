"""Issue 25 acceptance 3, the UNet gate: is there a step-caching setting on models/shapes-sd-onnx reaching
>= 1.8x at >= 30 dB mean PSNR with strict accuracy within 1 point of uncached (32 held-out prompts, 1 thread),
and on its int8-static folder >= 2x over int8 uncached at the same PSNR / strict gate?

    python experiments/unet_cache_gate/search.py [--int8 WORK] [--count 32] [--out experiments/unet_cache_gate/results]

Candidates: DeepCache with the shallow part in whole down/up block pairs (deepcache:INTERVAL[:BRANCH], the first
setting shipped) and at DeepCache's layer granularity (deepcache:INTERVAL:L<N>: conv_in, N - 1 down layers and the
last N up resnets always run).  `--int8 WORK`: the int8 candidates too, on WORK/shapes-sd-onnx-int8-static
(quantized there with the default int8-static calibration when missing).  Reuses bench/cache_pareto.py's generation
and comparison (settings interleaved prompt by prompt, CPU time per image end to end, speed-up = median of the
per-prompt ratios).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cache_pareto as cp  # noqa: E402

FP32 = ["deepcache:3", "deepcache:4", "deepcache:5", "deepcache:3:L2", "deepcache:4:L2", "deepcache:2:L1",
        "deepcache:3:L1", "deepcache:4:L1"]
INT8 = ["deepcache:3", "deepcache:4", "deepcache:2:L1", "deepcache:3:L1", "deepcache:4:L1"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--int8", type=Path, default=None, metavar="WORK", help="also the int8-static candidates")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "unet_cache_gate" / "results")
    args = ap.parse_args()
    results = {"machine": cp.cpu_info(), "models": {"sd": cp.run_model("sd", args.count, FP32)}}
    if args.int8 is not None:
        results["models"]["sd int8-static"] = cp.run_model("sd", args.count, INT8, args.int8)
    results["machine"]["load_after"] = cp.os.getloadavg()[0]
    cp.write_json(args.out.with_suffix(".json"), results, None)
    md = cp.markdown(results).replace("on the embedded models", "on the embedded UNet, the gate search")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
