#!/usr/bin/env python
"""Image PSNR of `generate` vs diffusers for every flow sampler on the tiny SD3, Flux and Qwen-Image pipelines
(issue 11, acceptance 1), the numbers behind tests/families/test_flow_families.py and tests/families/test_family_sd3.py.

flow_euler runs diffusers' FlowMatchEulerDiscreteScheduler as shipped. flow_heun on SD3 runs diffusers'
FlowMatchHeunDiscreteScheduler as shipped; on Flux / Qwen-Image (whose pipelines hand the scheduler base sigmas
and mu, which its set_timesteps does not take) and dpmpp_2m everywhere, diffusers' scheduler is driven on the
folder's flow-match sigmas (tests/helpers/flow_twins.py: its own set_timesteps layout, its own step()).

    python experiments/families/flow_sampler_parity.py     # -> bench/results/flow_sampler_parity.{json,md}
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "tests" / "helpers", ROOT / "models" / "training"):
    sys.path.insert(0, str(p))
OUT = Path(__file__).resolve().parent / "flow_sampler_parity"
H = W = 32
STEPS = 4
PROMPT = "a small red circle on the left"
TWINS = {"flow_euler": "FlowMatchEulerDiscreteScheduler", "flow_heun": "FlowMatchHeunDiscreteScheduler",
         "dpmpp_2m": "DPMSolverMultistepScheduler"}


def main() -> None:
    import diffusers
    import numpy as np
    import torch
    from conftest import export_family
    from family_pipelines import build_tiny_sd3
    from flow_twins import driven
    from tiny_families import build_tiny_flux, build_tiny_qwenimage

    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline

    def twin(ref, sampler, sigmas_given: bool):
        cls = getattr(diffusers, TWINS[sampler])
        native = sampler == "flow_euler" or (sampler == "flow_heun" and not sigmas_given)
        if native and (not sigmas_given or "sigmas" in inspect.signature(cls.set_timesteps).parameters):
            return cls.from_config(ref.scheduler.config), "diffusers' scheduler as shipped"
        return driven(sampler, ref.scheduler.config), "diffusers' scheduler driven on the folder's flow-match sigmas"

    rows = []
    with tempfile.TemporaryDirectory(prefix="flowparity-") as tmp:
        tmp = Path(tmp)
        cases = {
            "sd3": (build_tiny_sd3(tmp / "sd3"), diffusers.StableDiffusion3Pipeline),
            "flux": (build_tiny_flux(tmp), diffusers.FluxPipeline),
            "qwenimage": (build_tiny_qwenimage(tmp), diffusers.QwenImagePipeline),
        }
        for family, (src, cls) in cases.items():
            onnx_dir = export_family(src, tmp / f"{family}-onnx")
            ours = Pipeline.from_folder(onnx_dir)
            ref = cls.from_pretrained(src, local_files_only=True)
            ref.set_progress_bar_config(disable=True)
            sigmas_given = ours.family.base_sigmas(STEPS) is not None  # the pipeline hands its scheduler sigmas
            shape = ours.family.latent_shape(ours.info, 1, H, W)
            latents = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            for sampler in TWINS:
                ref.scheduler, how = twin(ref, sampler, sigmas_given)
                # the family's own diffusers call arguments (what `generate` does at this guidance), with a negative
                kw = {**ours.family.diffusers_call(ours.info, 4.0), "negative_prompt": "blurry"}
                want = ref(PROMPT, height=H, width=W, num_inference_steps=STEPS, latents=torch.from_numpy(latents),
                           output_type="np", **kw).images
                got = ours(PROMPT, negative_prompt="blurry", steps=STEPS, sampler=sampler, guidance=4.0, height=H,
                           width=W, latents=latents)
                db = psnr(got.images, (want * 255).round().astype(np.uint8))
                rows.append({"family": family, "sampler": sampler, "psnr_db": db, "diffusers": how,
                             "steps": STEPS, "size": [H, W]})
                print(json.dumps(rows[-1]), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp_json = OUT.with_suffix(".json.tmp")
    tmp_json.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp_json, OUT.with_suffix(".json"))
    lines = ["# Flow samplers: `generate` vs diffusers (tiny random-weight pipelines, 32x32, 4 steps)", "",
             "uint8 image PSNR; >= 40 dB is acceptance 1 (inf: identical images). "
             "Reproduce: `python experiments/families/flow_sampler_parity.py`.", "",
             "| family | sampler | PSNR dB | diffusers side |", "|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['sampler']} | {r['psnr_db']:.1f} | {r['diffusers']} |" for r in rows]
    tmp_md = OUT.with_suffix(".md.tmp")
    tmp_md.write_text("\n".join(lines) + "\n")
    os.replace(tmp_md, OUT.with_suffix(".md"))


if __name__ == "__main__":
    main()
