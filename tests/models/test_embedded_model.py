"""The shipped model: diffusers loads it, the exported ONNX folder reproduces it, and it follows prompts."""

import json

import numpy as np
import pytest
from cli_helpers import run_cli_here

from onnxdiffusion.evaluate import scenes as S
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.folder.paths import default_model_folder, embedded_diffusers_folder
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

SIZE_LIMIT = 30 * 1024 * 1024


def folder_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_shipped_model_and_judge_fit_the_size_budget():
    from onnxdiffusion.evaluate.judge import DEFAULT_JUDGE_PATH

    weights = folder_bytes(embedded_diffusers_folder())
    judge = folder_bytes(DEFAULT_JUDGE_PATH.parent)
    assert weights + judge <= SIZE_LIMIT, (weights, judge)


def test_onnx_folder_matches_diffusers_per_image():
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = Pipeline.from_folder(default_model_folder())
    prompts = [sc.caption for sc in S.scenes("heldout", 4)]
    ours = pipe(prompts, batch=4, steps=20, sampler="ddim", guidance=4.0, seed=11)
    ref_pipe = StableDiffusionPipeline.from_pretrained(embedded_diffusers_folder(), local_files_only=True)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = ref_pipe(prompts, latents=torch.from_numpy(ours.init_latents), num_inference_steps=20, guidance_scale=4.0,
                   output_type="np", height=64, width=64).images
    ref = (ref * 255).round().astype(np.uint8)
    for a, b in zip(ours.images, ref):
        assert psnr(a, b) >= 40.0


def test_default_model_from_the_cli(tmp_path):
    out = tmp_path / "circle.png"
    # in-process: the default model's lookup is the library's; an interpreter start would add ~1 CPU s
    proc = run_cli_here("generate", "a large red circle on the left", "-o", out, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    img = np.asarray(Image.open(out))
    assert img.shape == (64, 64, 3)


def test_follows_prompts_on_heldout_compositions():
    """A small deterministic sample of the evaluation (the full one is in the model card).

    Regression guards for the shipped model (measured 1.0 attribute / 1.0 strict on these 32
    pairs); an untrained model scores near 0.1 / 0.0 here, the first model (no parse loss) 0.44 / 0.41.
    """
    from onnxdiffusion.evaluate.judge import Judge
    from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, generate_set, heldout_scenes

    card = json.loads((embedded_diffusers_folder() / "eval.json").read_text())
    opts = EvaluateOptions(count=32, guidance=card["options"]["guidance"])
    scenes = heldout_scenes(opts)
    images = generate_set(Pipeline.from_folder(), scenes, opts, progress=False)
    result = evaluate_images(images, scenes, Judge.from_file())
    assert result["attribute_accuracy"] >= 0.9
    assert result["strict_accuracy"] >= 0.8


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m"])
def test_other_samplers_also_draw_the_object(sampler):
    from onnxdiffusion.evaluate.judge import Judge, score_scenes, summarize

    scenes = S.scenes("heldout", 8)
    pipe = Pipeline.from_folder()
    images = pipe([sc.caption for sc in scenes], batch=8, steps=20, sampler=sampler, guidance=4.0, seed=0).images
    summary = summarize(score_scenes(scenes, Judge.from_file().predict(images)))
    # measured 1.0 attribute / 1.0 strict for both; chance is about 0.05 per attribute
    assert summary["attribute_accuracy"] >= 0.85 and summary["strict_accuracy"] >= 0.6
