"""Run Hugging Face Optimum's ONNX Runtime Stable Diffusion pipeline on an `onnxdiffusion export` folder.

Run it with the Python of a separate environment that has `optimum-onnx[onnxruntime]` (never the
project's own venv), e.g.:

    .venv-optimum/bin/python bench/optimum_interop.py MODEL_FOLDER latents.npy out.npy \
        --prompt "a red circle" --steps 8 --guidance 5.0

It loads MODEL_FOLDER with `optimum.onnxruntime.ORTStableDiffusionPipeline.from_pretrained`
(offline), forces a DDIM scheduler built from the folder's scheduler config, feeds the given
initial latents (shape (batch, C, h, w), float32), and saves the images as a uint8 array of shape
(batch, H, W, 3) -- the same convention as `onnxdiffusion.runtime.Pipeline` -- so a test in the
project's venv can compare the two. A JSON summary (versions, timings) goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="folder written by `onnxdiffusion export`")
    ap.add_argument("latents", type=Path, help=".npy with the initial latents, (batch, C, h, w)")
    ap.add_argument("out", type=Path, help=".npy to write the uint8 images (batch, H, W, 3) to")
    ap.add_argument("--prompt", default="a red circle on the left")
    ap.add_argument("--negative-prompt", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--scheduler", choices=("ddim", "folder"), default="ddim",
                    help="ddim: DDIMScheduler.from_config(folder's config) (default); folder: as saved")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    args = ap.parse_args(argv)

    import numpy as np
    import onnxruntime as ort
    import torch
    from diffusers import DDIMScheduler

    import optimum.onnxruntime
    from optimum.onnxruntime import ORTStableDiffusionPipeline

    torch.set_num_threads(max(1, args.threads))
    latents = np.load(args.latents).astype(np.float32)
    if latents.ndim != 4:
        print(f"error: latents must be 4-D (batch, C, h, w), got shape {latents.shape}", file=sys.stderr)
        return 2

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    t0 = time.time()
    pipe = ORTStableDiffusionPipeline.from_pretrained(
        args.model, export=False, provider="CPUExecutionProvider", session_options=so, local_files_only=True,
    )
    load_s = time.time() - t0
    if args.scheduler == "ddim":
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)

    batch = latents.shape[0]
    factor = pipe.vae_scale_factor
    negative = None if args.negative_prompt is None else [args.negative_prompt] * batch
    t0 = time.time()
    images = pipe(
        [args.prompt] * batch, negative_prompt=negative, latents=torch.from_numpy(latents),
        num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="np",
        height=latents.shape[2] * factor, width=latents.shape[3] * factor,
    ).images
    gen_s = time.time() - t0
    images = (np.asarray(images) * 255).round().astype(np.uint8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, images)

    import diffusers
    import transformers

    print(json.dumps({
        "out": str(args.out),
        "shape": list(images.shape),
        "pipeline_class": type(pipe).__name__,
        "scheduler": type(pipe.scheduler).__name__,
        "load_seconds": round(load_s, 3),
        "generate_seconds": round(gen_s, 3),
        "versions": {
            "optimum": getattr(optimum.onnxruntime, "__version__", None) or _dist_version("optimum"),
            "optimum-onnx": _dist_version("optimum-onnx"),
            "onnxruntime": ort.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }))
    return 0


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
