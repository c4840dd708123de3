#!/usr/bin/env python
"""Quantized siblings of the full-size (SD1.5-sized, random-weight) export, for `bench --arch sd15`.

`onnxdiffusion quantize` holds the backbone as one in-memory ModelProto, which protobuf cannot
serialize past 2 GB, so on the 3.4 GB SD1.5 UNet it stops with "Failed to serialize proto" (measured
here). Until it streams external data, this script makes the bench's full-size quantized folders with
ONNX Runtime's own quantizers on files (external data in and out), using the recipes' defaults:

  int8-dynamic  Conv + MatMul weights uint8 per tensor, activations quantized at run time
  int8-static   QDQ: per-channel symmetric int8 weights (Conv, MatMul with constant B, Gemm), uint8
                activations calibrated (min/max) on the fp32 pipeline's own DDIM trajectories at the
                bench size; MatMul outputs stay float (ORT runs them as MatMulIntegerToFloat)

Each folder is the fp32 folder hard-linked, with unet/ replaced and a manifest whose `quantization`
names the recipe (the bench reads only that) and whose int8 UNet disables the NCHWc/NHWC rewrites as
the quantize verb's folders do. The weights are random: these folders are for speed, memory and size.

    python bench/sd15_quantize.py /tmp/sd15-bench/onnx --recipes int8-dynamic int8-static --size 256
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


INT8_DISABLED = ["NchwcTransformer", "NhwcTransformer"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] sd15_quantize: {msg}", file=sys.stderr, flush=True)


def link_tree(src: Path, dst: Path, skip: str) -> None:
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if rel.parts[0] == skip or p.name == "manifest.json":
            continue
        if p.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, dst / rel)
            except OSError:
                shutil.copy2(p, dst / rel)


def calibration_feeds(model: Path, prompts: list[str], steps: int, size: int, guidance: float):
    """The UNet's inputs at every step of the fp32 pipeline's DDIM trajectories (batch 2: uncond + cond)."""
    from onnxdiffusion.evaluate.run import item_latents
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.runtime.backbone import GuidedBackbone
    from onnxdiffusion.runtime.pipeline import GenerateOptions
    from onnxdiffusion.samplers import sample

    pipe = Pipeline.from_folder(model, verify=False, threads=1)
    table = pipe.table(GenerateOptions(steps=steps, sampler="ddim"))
    shape = pipe.latent_shape_for(1, size, size)[1:]
    feeds = []
    for i, prompt in enumerate(prompts):
        log(f"calibration trajectory {i + 1}/{len(prompts)} ({steps} steps at {size}x{size})")
        gb = GuidedBackbone(pipe.unet, (1, *shape), pipe.encode_prompt([prompt]), pipe.encode_prompt([""]), guidance)

        def model_fn(x, t, gb=gb):
            out = gb(x, t)
            feeds.append({"sample": gb.sample.copy(), "timestep": gb.timestep.copy(),
                          "encoder_hidden_states": gb.context.copy()})
            return out

        sample(model_fn, item_latents(shape, [10000 + i]), table)
    return feeds


class Reader:
    def __init__(self, feeds):
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def quantize_unet(recipe: str, src: Path, dst: Path, feeds=None) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    logging.getLogger().setLevel(logging.ERROR)
    if recipe == "int8-dynamic":
        quantize_dynamic(src, dst, op_types_to_quantize=["Conv", "MatMul"], per_channel=False, reduce_range=False,
                         weight_type=QuantType.QUInt8, use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True})
    elif recipe == "int8-static":
        quantize_static(src, dst, Reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["Conv", "MatMul", "Gemm"], per_channel=True, reduce_range=False,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
                        extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, "MatMulConstBOnly": True,
                                       "OpTypesToExcludeOutputQuantization": ["MatMul"],
                                       "CalibMaxIntermediateOutputs": 1})
    else:
        raise SystemExit(f"unknown recipe {recipe}")


def make(model: Path, recipe: str, args) -> Path:
    from onnxdiffusion.artifacts import hash_tree, write_json

    out = model.parent / recipe
    if (out / "manifest.json").is_file() and not args.overwrite:
        log(f"{out} exists (--overwrite to redo)")
        return out
    manifest = json.loads((model / "manifest.json").read_text())
    unet = manifest["components"]["unet"]
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe}.", dir=model.parent))
    try:
        t0 = time.perf_counter()
        link_tree(model, tmp, "unet")
        (tmp / "unet").mkdir()
        feeds = None
        if recipe == "int8-static":
            prompts = ["a red circle above a blue square", "a small green star on the left"][: args.calib_prompts]
            feeds = calibration_feeds(model, prompts, args.calib_steps, args.size, 7.5)
        log(f"{recipe}: quantizing {model / unet['path']}")
        quantize_unet(recipe, model / unet["path"], tmp / "unet" / "model.onnx", feeds)
        data = sorted(p.name for p in (tmp / "unet").iterdir() if p.name != "model.onnx")
        unet = dict(unet, precision=recipe, external_data=[f"unet/{d}" for d in data],
                    bytes=sum(p.stat().st_size for p in (tmp / "unet").iterdir()),
                    session_options={"disabled_optimizers": INT8_DISABLED})
        unet.pop("validation", None)
        manifest["components"]["unet"] = unet
        manifest["quantization"] = {
            "recipe": recipe, "made_by": "bench/sd15_quantize.py (ONNX Runtime's quantizers on files; random "
                                         "weights: for speed, memory and size only)",
            "calibration": None if feeds is None else {"prompts": args.calib_prompts, "steps": args.calib_steps,
                                                       "size": args.size, "backbone_calls": len(feeds)},
            "seconds": round(time.perf_counter() - t0, 1)}
        manifest["files"] = hash_tree(tmp)
        write_json(tmp / "manifest.json", manifest)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{recipe}: {out} ({unet['bytes'] / 1e6:.0f} MB UNet)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="the full-size fp32 export (bench --arch sd15 builds it under WORK/onnx)")
    ap.add_argument("--recipes", nargs="+", default=["int8-dynamic", "int8-static"])
    ap.add_argument("--size", type=int, default=256, help="calibration image size (the bench's)")
    ap.add_argument("--calib-prompts", type=int, default=2)
    ap.add_argument("--calib-steps", type=int, default=10)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    for recipe in args.recipes:
        make(args.model.resolve(), recipe, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
