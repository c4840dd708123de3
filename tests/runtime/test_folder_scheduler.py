"""The folder's scheduler is honoured: its class picks the default sampler, its options shape the
table, end to end against diffusers' pipeline with the same scheduler; and the clip_sample
columns run the same in the ONNX loop graph as in the host loop."""

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.samplers import guided, sample, table_from_config
from onnxdiffusion.loopgraph.builder import build_sampling_graph

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
FOLDER_SCHEDULERS = [
    ("euler", {"_class_name": "EulerDiscreteScheduler", **SD, "use_karras_sigmas": True, "timestep_spacing": "trailing"}),
    ("ddim", {"_class_name": "DDIMScheduler", **SD, "clip_sample": True, "clip_sample_range": 0.5,
              "set_alpha_to_one": False}),
    ("dpmpp_2m", {"_class_name": "DPMSolverMultistepScheduler", **SD, "use_exponential_sigmas": True,
                  "final_sigmas_type": "sigma_min", "lower_order_final": False}),
    # what real SD folders ship (PNDM, UniPC), and the few-step ones (LCM, TCD, SD-Turbo's Euler-a trailing)
    ("pndm", {"_class_name": "PNDMScheduler", **SD, "skip_prk_steps": True, "set_alpha_to_one": False}),
    ("unipc", {"_class_name": "UniPCMultistepScheduler", **SD}),
    ("unipc", {"_class_name": "UniPCMultistepScheduler", **SD, "solver_order": 3, "use_karras_sigmas": True}),
    ("lcm", {"_class_name": "LCMScheduler", **SD}),
    ("tcd", {"_class_name": "TCDScheduler", **SD}),
    ("euler_a", {"_class_name": "EulerAncestralDiscreteScheduler", **SD, "timestep_spacing": "trailing"}),
]
# TCDScheduler.step's gamma default; diffusers' pipelines pass eta=0.0 unless told (TCD's docs pass 0.3)
_STEP_KW = {"TCDScheduler": {"eta": 0.3}}


def _with_scheduler(src, dst, config):
    shutil.copytree(src, dst)
    (dst / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("sampler,config", FOLDER_SCHEDULERS,
                         ids=[f"{s}-{i}" for i, (s, _) in enumerate(FOLDER_SCHEDULERS)])
def test_default_sampler_is_the_folders(tiny_diffusers, tiny_onnx, tmp_path, sampler, config):
    import diffusers
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = Pipeline.from_folder(_with_scheduler(tiny_onnx, tmp_path / "m", config), verify=False)
    ours = pipe("a red circle on the left", steps=6, guidance=4.0, seed=5)  # no sampler named
    assert ours.settings["sampler"] == sampler

    ref = StableDiffusionPipeline.from_pretrained(tiny_diffusers, local_files_only=True)
    ref.scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    ref.set_progress_bar_config(disable=True)
    lat = ours.init_latents
    kw = _STEP_KW.get(config["_class_name"], {})
    with _per_step_noise(ref.scheduler, ours.noise):
        img = ref("a red circle on the left", latents=torch.from_numpy(lat), num_inference_steps=6, guidance_scale=4.0,
                  output_type="np", height=lat.shape[2] * 4, width=lat.shape[3] * 4, **kw).images
    db = psnr(ours.images, (img * 255).round().astype(np.uint8))
    print(f"\n{config['_class_name']} ({sampler}): {db:.1f} dB vs diffusers")
    assert db >= 40.0


def _per_step_noise(scheduler, noise):
    """diffusers draws ancestral noise inside step(); hand it ours, one row per step (our convention)."""
    import contextlib
    import importlib
    from unittest import mock

    import torch

    if noise is None:
        return contextlib.nullcontext()
    draws = iter(noise)
    mod = importlib.import_module(type(scheduler).__module__)
    return mock.patch.object(mod, "randn_tensor", lambda *a, **k: torch.from_numpy(next(draws)))


def test_unreproduced_folder_option_is_a_one_line_error(tiny_onnx, tmp_path):
    config = {"_class_name": "DPMSolverMultistepScheduler", **SD, "thresholding": True}
    with pytest.raises(UserError, match="thresholding=True") as info:
        Pipeline.from_folder(_with_scheduler(tiny_onnx, tmp_path / "m", config), verify=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_clip_sample_runs_in_loop_graphs(form):
    from test_loop_graph import toy_backbone, toy_eager

    config = {"_class_name": "DDIMScheduler", **SD, "clip_sample": True, "clip_sample_range": 0.2}
    table = table_from_config(config, 5)
    assert table.column("k").all() and np.all(table.column("r") == np.float32(0.2))
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond, uncond = rng.standard_normal((2, 2, 3, 8), dtype=np.float32)
    backbone = toy_backbone()
    host = sample(guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 3.0), latents, table)
    unclipped = sample(guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 3.0), latents,
                       table_from_config({**config, "clip_sample": False}, 5))
    assert np.linalg.norm(host - unclipped) > 1e-2 * np.linalg.norm(host)  # the clip did something
    graph = build_sampling_graph(backbone, form, 5 if form == "unrolled" else None)
    feeds = {"latents": latents, "cond": cond, "uncond": uncond, "table": table.rows,
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32),
             "noise": np.zeros((1, *latents.shape), np.float32)}
    if form == "loop":
        feeds["steps"] = np.array(5, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.linalg.norm(got - host) / np.linalg.norm(host) < 1e-5


def test_graphs_compiled_before_the_clip_columns_still_run():
    """A sampling graph that reads 8 table columns gets the first 8 when r, k are unused, else an error."""
    from types import SimpleNamespace

    from onnxdiffusion.folder.manifest import Component
    from onnxdiffusion.runtime.sampling_graph import SamplingGraph

    inputs = [SimpleNamespace(name="latents", shape=["b", 4, "h", "w"]), SimpleNamespace(name="table", shape=["n", 8])]
    graph = SamplingGraph(SimpleNamespace(get_inputs=lambda: inputs),
                          Component.from_dict("sampler_loop", {"form": "loop", "path": "sampler_loop.onnx"}))
    latents = np.zeros((1, 4, 4, 4), np.float32)
    plain = table_from_config({"_class_name": "DDIMScheduler", **SD, "clip_sample": False}, 4)
    assert graph.feeds(plain, latents, None, 3.0)["table"].shape == (4, 8)
    clipped = table_from_config({"_class_name": "DDIMScheduler", **SD, "clip_sample": True}, 4)
    with pytest.raises(UserError, match="recompile"):
        graph.feeds(clipped, latents, None, 3.0)


@pytest.mark.slow  # 7-13 s each: the whole suite (make test) runs it, test-fast does not
def test_lcm_distilled_unet_embeds_the_guidance_scale(tiny_diffusers, tmp_path):
    """An LCM-distilled UNet (time_cond_proj_dim) takes w = guidance - 1 as timestep_cond and runs without
    CFG, as diffusers' pipeline runs it: export gives the UNet a `guidance` input, the runtime feeds it."""
    import onnx
    import torch
    from diffusers import LCMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    from onnxdiffusion.export import export_pipeline

    ref = StableDiffusionPipeline.from_pretrained(tiny_diffusers, local_files_only=True)
    torch.manual_seed(1)
    ref.unet = UNet2DConditionModel.from_config({**ref.unet.config, "time_cond_proj_dim": 8})
    ref.scheduler = LCMScheduler.from_config(ref.scheduler.config)
    ref.save_pretrained(tmp_path / "lcm", safe_serialization=True)
    export_pipeline(tmp_path / "lcm", tmp_path / "onnx", progress=False)
    unet_inputs = [i.name for i in onnx.load(tmp_path / "onnx" / "unet" / "model.onnx", load_external_data=False).graph.input]
    assert unet_inputs[-1] == "guidance"

    pipe = Pipeline.from_folder(tmp_path / "onnx", verify=False)
    ref.set_progress_bar_config(disable=True)
    dbs = []
    for guidance in (1.0, 6.0):
        ours = pipe("a red circle on the left", steps=4, guidance=guidance, seed=3)
        assert ours.settings["sampler"] == "lcm"
        lat = ours.init_latents
        with _per_step_noise(ref.scheduler, ours.noise):
            img = ref("a red circle on the left", latents=torch.from_numpy(lat), num_inference_steps=4,
                      guidance_scale=guidance, output_type="np", height=lat.shape[2] * 4, width=lat.shape[3] * 4).images
        dbs.append(psnr(ours.images, (img * 255).round().astype(np.uint8)))
    print(f"\nLCM-distilled UNet, guidance 1 / 6: {dbs[0]:.1f} / {dbs[1]:.1f} dB vs diffusers")
    assert min(dbs) >= 40.0
    a, b = (pipe("a red circle on the left", steps=4, guidance=g, seed=3).images for g in (1.0, 6.0))
    assert np.abs(a.astype(int) - b.astype(int)).max() > 0  # the embedding reaches the image
