#!/usr/bin/env python
"""Z-Image against diffusers (issue 42, acceptance 1): image PSNR of `generate` vs ZImagePipeline from the same
initial latents on the tiny pipeline of tests/helpers/tiny_families.py (its own configs: a 3-layer Qwen3 with
grouped-query attention, random pad tokens, Z-Image-Turbo's scheduler), at 48x32 (non-square; 24 image tokens
padded to 32), host loop and Loop graph, every flow sampler, with and without guidance, a negative prompt longer
than the prompt; then int8-static (4 calibration prompts) against fp32 on held-out prompt-seed pairs.

    python experiments/families/zimage_parity.py [--work DIR (default: the temporary folder)]
        -> experiments/families/zimage_parity.json and .md (the numbers in docs/families/zimage.md)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent
H, W, STEPS = 48, 32, 4
PROMPT = "a small red circle on the left"
NEGATIVE = ("blurry, low quality, a photo of a cat, a big blue square above a yellow triangle on the right, "
            "a green ring below a violet star")
CASES = [("guidance 3, no negative", 3.0, None), ("guidance 0 (no CFG)", 0.0, None),
         ("guidance 4, long negative", 4.0, NEGATIVE)]
HELD_OUT = ["a blue square above a yellow triangle", "a green ring on the right", "two violet stars",
            "a big orange circle below a small blue square", "a yellow star in the middle", "a red triangle"]


def _folders(work: Path) -> tuple[Path, Path]:
    sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "families")]
    import tiny_families

    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.loopgraph.compile import compile_loop

    src = tiny_families.build_tiny_zimage(work)
    out = work / "onnx"
    export_pipeline(src, out, ExportOptions(components=("text_encoder", "transformer", "vae_decoder"), default_size=32,
                                            overwrite=True), progress=False)
    compile_loop(out, out, form="loop")
    return src, out


def _ref_images(ref, latents, guidance, negative, sampler):
    from test_flow_families import _scheduler

    own = ref.scheduler
    if sampler != "flow_euler":
        ref.scheduler = _scheduler(ref, sampler)
    try:
        out = ref(PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance, latents=latents,
                  output_type="np", **({} if negative is None else {"negative_prompt": negative})).images
    finally:
        ref.scheduler = own
    return (out * 255).round().astype("uint8")


def measure(work: Path) -> dict:
    import numpy as np
    import torch
    from diffusers import ZImagePipeline

    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.samplers import FLOW_SAMPLERS

    src, folder = _folders(work)
    ref = ZImagePipeline.from_pretrained(src)
    ref.set_progress_bar_config(disable=True)
    pipe = Pipeline.from_folder(folder)
    rows = []
    for seed, (label, guidance, negative) in enumerate(CASES):
        for sampler in FLOW_SAMPLERS:
            latents = torch.randn(1, 4, H // 4, W // 4, generator=torch.Generator().manual_seed(seed))
            want = _ref_images(ref, latents, guidance, negative, sampler)
            kw = dict(negative_prompt=negative, steps=STEPS, sampler=sampler, guidance=guidance, height=H, width=W,
                      latents=latents.numpy())
            rows.append({"case": label, "sampler": sampler, "host_db": round(float(psnr(pipe(PROMPT, **kw).images, want)), 2),
                         "loop_db": round(float(psnr(pipe(PROMPT, loop="loop", **kw).images, want)), 2)})
    cal = CalibrationConfig(count=4, steps=STEPS, batch=4, sampler="flow_euler", guidance=3.0)
    out = work / "int8-static"
    shutil.rmtree(out, ignore_errors=True)
    report = quantize(folder, out, QuantizeConfig(recipe=recipe_class("int8-static")(), calibration=cal,
                                                  latency_runs=2, measure_memory=False))
    q = Pipeline.from_folder(out)
    pairs = [(p, i) for i, p in enumerate(HELD_OUT)]
    kw = dict(steps=STEPS, guidance=3.0, height=H, width=W)
    fp = np.concatenate([pipe(p, seed=100 + i, **kw).images for p, i in pairs])
    qi = np.concatenate([q(p, seed=100 + i, **kw).images for p, i in pairs])
    per = [float(psnr(qi[k:k + 1], fp[k:k + 1])) for k in range(len(pairs))]
    int8 = {"pairs": len(pairs), "mean_db": round(float(np.mean(per)), 2), "worst_db": round(min(per), 2),
            "probe_psnr_db": report["quality"]["probe_psnr_db"],
            "backbone_bytes": {"fp32": (folder / "transformer" / "model.onnx").stat().st_size,
                               "int8": sum(p.stat().st_size for p in (out / "transformer").glob("*") if p.is_file())}}
    return {"parity": rows, "int8_static": int8, "size": [H, W], "steps": STEPS}


def table(result: dict) -> str:
    lines = ["| case | sampler | host vs diffusers | Loop graph vs diffusers |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['sampler']} | {r['host_db']:.1f} dB | {r['loop_db']:.1f} dB |" for r in result["parity"]]
    q = result["int8_static"]
    lines += ["", f"int8-static vs fp32, {q['pairs']} held-out prompt-seed pairs: mean {q['mean_db']:.1f} dB, worst "
                  f"{q['worst_db']:.1f} dB (quantize's probe: {q['probe_psnr_db']:.1f} dB); transformer "
                  f"{q['backbone_bytes']['fp32']} -> {q['backbone_bytes']['int8']} bytes"]
    return "\n".join(lines).replace("inf dB", "identical") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "zimage_parity")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result = measure(args.work)
    here = Path(__file__).parent
    (here / "zimage_parity.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (here / "zimage_parity.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
