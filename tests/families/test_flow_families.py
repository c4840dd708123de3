"""Flux and Qwen-Image: `export` then `generate` reproduces the diffusers pipeline given the same
initial latents, prompt, steps and guidance (acceptance 1), for every flow sampler (Heun and
DPM-Solver++ through diffusers' schedulers driven on the pipelines' sigmas, flow_twins.py);
per-component ONNX-vs-PyTorch validation is recorded in the manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.samplers import FLOW_SAMPLERS

pytestmark = pytest.mark.slow

H = W = 32
STEPS = 4
PROMPT = "a small red circle on the left"
# sampler -> the diffusers scheduler class it reproduces (a new flow sampler must add its twin here)
TWINS = {"flow_euler": "FlowMatchEulerDiscreteScheduler", "flow_heun": "FlowMatchHeunDiscreteScheduler",
         "dpmpp_2m": "DPMSolverMultistepScheduler"}  # dpmpp_2m on a flow folder: DPM-Solver++ on flow sigmas


def _scheduler(pipe, sampler: str):
    """The diffusers scheduler `sampler` reproduces, configured from the folder's scheduler config.
    Flux and Qwen-Image hand their scheduler base sigmas and mu; a scheduler whose set_timesteps takes no
    sigmas is driven on the schedule those give (flow_twins.py: its own set_timesteps layout and step())."""
    import inspect

    import diffusers

    from flow_twins import driven

    if sampler not in TWINS:
        pytest.fail(f"sampler {sampler!r} has no diffusers twin in TWINS")
    cls = getattr(diffusers, TWINS[sampler])
    if "sigmas" not in inspect.signature(cls.set_timesteps).parameters:
        return driven(sampler, pipe.scheduler.config)
    return cls.from_config(pipe.scheduler.config)


def _uint8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def flux_pair(tiny_flux_diffusers, tiny_flux_onnx):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_flux_diffusers), Pipeline.from_folder(tiny_flux_onnx)


@pytest.fixture(scope="module")
def qwen_pair(tiny_qwenimage_diffusers, tiny_qwenimage_onnx):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_qwenimage_diffusers), Pipeline.from_folder(tiny_qwenimage_onnx)


def _packed_latents(pipe, channels: int, factor: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h, w = H // factor, W // factor
    return pipe._pack_latents(torch.randn(1, channels, h, w, generator=g), 1, channels, h, w)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 2, 7])
def test_driven_twins_reproduce_diffusers_own_set_timesteps(shift, steps):
    """Where diffusers' own set_timesteps applies (its grid, static shift), the driven twins lay out the same
    sigmas and timesteps (DPM's timesteps: diffusers truncates them to int64, the twin keeps flow-match's)."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler

    from flow_twins import driven

    config = FlowMatchEulerDiscreteScheduler(shift=shift).config
    real = FlowMatchHeunDiscreteScheduler.from_config(config)
    real.set_timesteps(steps)
    twin = driven("flow_heun", config)
    twin.set_timesteps(sigmas=np.linspace(real.sigma_max, real.sigma_min, steps) if steps > 1 else [real.sigma_max])
    torch.testing.assert_close(twin.sigmas, real.sigmas, rtol=1e-6, atol=0)
    torch.testing.assert_close(twin.timesteps, real.timesteps, rtol=1e-6, atol=0)

    real = DPMSolverMultistepScheduler.from_config(config, prediction_type="flow_prediction", use_flow_sigmas=True,
                                                   flow_shift=shift)
    real.set_timesteps(steps)
    twin = driven("dpmpp_2m", config)
    base = (1.0 - np.linspace(1, 1 / 1000, steps + 1))[::-1][:-1]
    twin.set_timesteps(sigmas=base)
    torch.testing.assert_close(twin.sigmas, real.sigmas, rtol=1e-6, atol=0)
    assert torch.equal(twin.timesteps.to(torch.int64), real.timesteps)


@pytest.mark.parametrize("onnx_fixture", ["tiny_flux_onnx", "tiny_qwenimage_onnx"])
def test_manifest_records_family_and_per_component_validation(onnx_fixture, request):
    manifest = json.loads((request.getfixturevalue(onnx_fixture) / "manifest.json").read_text())
    assert manifest["family"] in ("flux", "qwenimage")
    for name, comp in manifest["components"].items():
        assert comp["validation"]["max_rel_error"] < 1e-4, name
        first, second = comp["shapes_validated"]
        assert first != second and first["batch_size"] != second["batch_size"], name  # dynamic axes exercised


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_flux_generate_matches_diffusers(flux_pair, sampler):
    ref_pipe, pipe = flux_pair
    ref_pipe.scheduler = _scheduler(ref_pipe, sampler)
    latents = _packed_latents(ref_pipe, 4, 2, seed=0)
    t5_len = pipe.info["max_lengths"]["text_encoder_2"]
    want = ref_pipe(PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=3.5, latents=latents,
                    max_sequence_length=t5_len, output_type="np").images
    got = pipe(PROMPT, steps=STEPS, sampler=sampler, guidance=3.5, height=H, width=W, latents=latents.numpy())
    assert psnr(got.images, _uint8(want)) >= 40.0


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_qwenimage_generate_matches_diffusers(qwen_pair, sampler):
    ref_pipe, pipe = qwen_pair
    ref_pipe.scheduler = _scheduler(ref_pipe, sampler)
    latents = _packed_latents(ref_pipe, 4, 4, seed=1)
    # true CFG with a negative prompt of a different token length than the prompt
    want = ref_pipe(PROMPT, negative_prompt="blurry", true_cfg_scale=4.0, height=H, width=W,
                    num_inference_steps=STEPS, latents=latents, output_type="np").images
    got = pipe(PROMPT, negative_prompt="blurry", steps=STEPS, sampler=sampler, guidance=4.0, height=H, width=W,
               latents=latents.numpy())
    assert psnr(got.images, _uint8(want)) >= 40.0


def test_qwen_prompt_template_is_the_pipelines(qwen_pair):
    ref_pipe, pipe = qwen_pair
    assert pipe.info["prompt_template"] == ref_pipe.prompt_template_encode
    assert pipe.info["prompt_template_drop"] == ref_pipe.prompt_template_encode_start_idx
    assert pipe.info["max_prompt_tokens"] == ref_pipe.tokenizer_max_length


def test_flux_folder_without_t5_is_refused(tiny_flux_diffusers, tmp_path):
    import shutil

    from onnxdiffusion.export import export_pipeline

    src = tmp_path / "flux"
    shutil.copytree(tiny_flux_diffusers, src)
    index = json.loads((src / "model_index.json").read_text())
    del index["text_encoder_2"]
    (src / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="text_encoder_2"):
        export_pipeline(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("onnx_fixture,negative,guidance", [("tiny_flux_onnx", None, 3.5),
                                                            ("tiny_qwenimage_onnx", "blurry", 4.0)])
def test_loop_and_unrolled_forms_match_the_host_loop(onnx_fixture, negative, guidance, request, tmp_path):
    """Acceptance 3: Flux's graph runs cond only (guidance is a backbone input); Qwen-Image's runs
    the padded [uncond; cond] batch with the norm-rescaled CFG inside."""
    import shutil

    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(onnx_fixture), folder)
    compile_loop(folder, folder, form="loop")
    compile_loop(folder, folder, form="unrolled", steps=3)
    pipe = Pipeline.from_folder(folder)
    kw = dict(steps=3, sampler="flow_euler", guidance=guidance, height=H, width=W, seed=3)
    host = pipe(PROMPT, negative_prompt=negative, **kw)
    for form in ("loop", "unrolled"):
        got = pipe(PROMPT, negative_prompt=negative, loop=form, **kw)
        assert psnr(got.images, host.images) >= 60.0, form
        span = float(host.latents.max() - host.latents.min())
        assert psnr(got.latents, host.latents, data_range=span) >= 60.0, form


@pytest.mark.filterwarnings("ignore:prompt truncated")  # calibration captions are longer than the tiny T5's 16 tokens
@pytest.mark.parametrize("onnx_fixture,negative", [("tiny_flux_onnx", None), ("tiny_qwenimage_onnx", "blurry")])
@pytest.mark.parametrize("name,options", [("fp16", {"components": "unet"}), ("int8-dynamic", {}),
                                          ("int8-static", {}), ("int4-weights", {"block_size": "16"})])
def test_quantized_backbone_runs_and_its_loop_form_matches_the_host_loop(onnx_fixture, negative, name, options,
                                                                         request, tmp_path):
    """Acceptance 4 (quality is judged on a trained model, not here): calibration captures the
    family's own conditioning (ids, mask, embedded guidance) over flow_euler trajectories."""
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    cal = CalibrationConfig(count=4, steps=3, batch=4, sampler="flow_euler")
    out = tmp_path / name
    report = quantize(request.getfixturevalue(onnx_fixture), out,
                      QuantizeConfig(recipe=recipe_class(name).with_options(options), calibration=cal,
                                     latency_runs=2, measure_memory=False))
    assert report["verdict"].startswith(("pays on cpu", "does not pay on cpu"))
    assert report["quality"]["probe_psnr_db"] > 20  # the quantized backbone still draws the same image
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, sampler="flow_euler", guidance=4.0, seed=1, height=H, width=W)
    host = pipe(PROMPT, negative_prompt=negative, **kw)
    loop = pipe(PROMPT, negative_prompt=negative, loop="loop", **kw)
    assert psnr(loop.images, host.images) >= 60



def test_flux_whole_graph_from_token_ids(tiny_flux_onnx, tmp_path):
    """Acceptance 3, `--whole` for Flux: CLIP and T5 ids in, uint8 image out (2x2 unpacking in the graph)."""
    import shutil

    import onnxruntime as ort

    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(tiny_flux_onnx, folder)
    compile_loop(folder, folder, form="loop", whole=True)
    pipe = Pipeline.from_folder(folder)
    host = pipe(PROMPT, steps=3, sampler="flow_euler", guidance=3.5, height=H, width=W, seed=4)
    table = pipe.table(pipe_options(steps=3, sampler="flow_euler", height=H, width=W))
    rows, cols = H // 4, W // 4
    cond = pipe.family.size_conditioning(pipe.info, 1, H, W)
    sess = ort.InferenceSession(str(folder / "sampler_loop_whole" / "model.onnx"), providers=["CPUExecutionProvider"])
    image = sess.run(["image"], {
        "input_ids": pipe.tokenizers["text_encoder"]([PROMPT]), "input_ids_2": pipe.tokenizers["text_encoder_2"]([PROMPT]),
        "latents": host.init_latents, "cond_img_ids": cond["img_ids"], "cond_guidance": np.array([3.5], np.float32),
        "grid_rows": np.array(rows, np.int64), "grid_cols": np.array(cols, np.int64),
        "table": table.rows, "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(1.0, np.float32),
        "noise": np.zeros((1, *host.init_latents.shape), np.float32), "steps": np.array(3, np.int64),
    })[0]
    assert image.dtype == np.uint8 and image.shape == host.images.shape
    assert psnr(image, host.images) >= 40


def pipe_options(**kw):
    from onnxdiffusion.runtime.pipeline import GenerateOptions

    return GenerateOptions(**kw)
