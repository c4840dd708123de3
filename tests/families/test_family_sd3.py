"""SD3 end to end: export -> generate against diffusers' StableDiffusion3Pipeline (with and without
T5), joint attention fused, loop forms and the whole pipeline as one graph."""

import json

import numpy as np
import onnxruntime as ort
import pytest
from family_pipelines import diffusers_images
from PIL import Image

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"
SIZE = (32, 32)


def test_manifest_records_family_and_per_component_validation(tiny_sd3_onnx):
    m = json.loads((tiny_sd3_onnx / "manifest.json").read_text())
    assert m["family"] == "sd3"
    assert set(m["components"]) == {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer",
                                    "vae_decoder", "vae_encoder"}
    for name, comp in m["components"].items():
        assert comp["family"] == "sd3"
        assert comp["validation"]["max_abs_error"] <= comp["validation"]["atol"], name
    assert [i["name"] for i in m["components"]["transformer"]["inputs"]] == [
        "sample", "timestep", "encoder_hidden_states", "pooled_projections"]
    # every joint attention block exported as one fused node
    assert m["attention"]["modules"]["transformer"] == 2
    # the two validation shapes differ in height/width and text length: the axes are dynamic
    a, b = m["components"]["transformer"]["shapes_validated"]
    assert a["sequence_length"] != b["sequence_length"] and a["width_latent"] != b["width_latent"]


@pytest.mark.parametrize("negative", [None, "a green ring"])
def test_matches_diffusers(tiny_sd3_diffusers, tiny_sd3_onnx, negative):
    pipe = Pipeline.from_folder(tiny_sd3_onnx)
    ours = pipe(PROMPT, negative_prompt=negative, steps=5, sampler="flow_euler", guidance=5.0, seed=3, batch=2)
    ref = diffusers_images(tiny_sd3_diffusers, [PROMPT] * 2, ours.init_latents, 5, 5.0,
                           negative=None if negative is None else [negative] * 2, image_size=SIZE)
    assert psnr(ours.images, ref) >= 40.0


@pytest.mark.parametrize("sampler", ["flow_heun", "dpmpp_2m"])
def test_second_order_flow_samplers_match_diffusers(tiny_sd3_diffusers, tiny_sd3_onnx, sampler):
    """Acceptance 1 for SD3's other flow samplers: FlowMatchHeunDiscreteScheduler runs in diffusers' SD3 pipeline
    as shipped; DPM-Solver++ on the folder's flow-match sigmas through flow_twins (its own grid would differ)."""
    import torch
    from diffusers import FlowMatchHeunDiscreteScheduler, StableDiffusion3Pipeline

    from flow_twins import driven

    pipe = Pipeline.from_folder(tiny_sd3_onnx)
    ours = pipe(PROMPT, negative_prompt="a green ring", steps=4, sampler=sampler, guidance=5.0, seed=3)
    ref_pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_diffusers, local_files_only=True)
    cfg = ref_pipe.scheduler.config
    ref_pipe.scheduler = FlowMatchHeunDiscreteScheduler.from_config(cfg) if sampler == "flow_heun" else driven(sampler, cfg)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = ref_pipe(PROMPT, negative_prompt="a green ring", latents=torch.from_numpy(ours.init_latents), height=SIZE[0],
                   width=SIZE[1], num_inference_steps=4, guidance_scale=5.0, output_type="np").images
    assert psnr(ours.images, (ref * 255).round().astype(np.uint8)) >= 40.0


def test_cli_generate_matches_diffusers(tiny_sd3_diffusers, tiny_sd3_onnx, tmp_path):
    """The `generate` verb (seeded latents) against diffusers' own FlowMatchEuler from the same latents."""
    out = tmp_path / "img.png"
    proc = run_cli_here("generate", tiny_sd3_onnx, PROMPT, "--steps", 4, "--seed", 11, "--guidance", 4.0,
                   "--sampler", "flow_euler", "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    latents = np.random.default_rng(11).standard_normal((1, 16, 8, 8), dtype=np.float32)
    ref = diffusers_images(tiny_sd3_diffusers, PROMPT, latents, 4, 4.0, image_size=SIZE)
    assert psnr(np.asarray(Image.open(out))[None], ref) >= 40.0


@pytest.fixture(scope="module")
def sd3_without_t5(tmp_path_factory):
    from family_pipelines import build_tiny_sd3

    from onnxdiffusion.export import export_pipeline

    src = build_tiny_sd3(tmp_path_factory.mktemp("sd3_no_t5"), with_t5=False)
    out = src.parent / "onnx"
    export_pipeline(src, out, progress=False, options=None)
    return src, out


def test_without_t5_matches_diffusers(sd3_without_t5):
    src, out = sd3_without_t5
    m = json.loads((out / "manifest.json").read_text())
    assert "text_encoder_3" not in m["components"] and m["pipeline"]["t5"] is False
    pipe = Pipeline.from_folder(out)
    ours = pipe(PROMPT, steps=4, sampler="flow_euler", guidance=4.0, seed=5)
    ref = diffusers_images(src, PROMPT, ours.init_latents, 4, 4.0, image_size=SIZE,
                           load_kwargs={"text_encoder_3": None, "tokenizer_3": None})
    assert psnr(ours.images, ref) >= 40.0


@pytest.fixture(scope="module")
def sd3_loops(tiny_sd3_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("sd3_loops") / "model"
    compile_loop(tiny_sd3_onnx, out, form="loop")
    compile_loop(out, out, form="unrolled", steps=4)
    compile_loop(out, out, form="loop", whole=True)
    return out


def test_loop_forms_match_host(sd3_loops):
    pipe = Pipeline.from_folder(sd3_loops)
    kw = dict(negative_prompt="a green ring", steps=4, sampler="flow_euler", guidance=5.0, seed=4, batch=2)
    host = pipe(PROMPT, **kw)
    for form in ("loop", "unrolled"):
        got = pipe(PROMPT, loop=form, **kw)
        assert psnr(got.images, host.images) >= 60, form


def test_whole_graph_from_token_ids(sd3_loops):
    """Token ids of the three encoders in, uint8 image out, ONNX Runtime alone."""
    pipe = Pipeline.from_folder(sd3_loops)
    host = pipe("a blue star", negative_prompt="a red ring", steps=4, sampler="flow_euler", guidance=4.0, seed=2)
    table = pipe.table(pipe_options(steps=4))
    feeds = {"latents": host.init_latents, "table": table.rows, "init_scale": np.array(table.init_scale, np.float32),
             "guidance": np.array(4.0, np.float32), "noise": np.zeros((1, *host.init_latents.shape), np.float32),
             "steps": np.array(4, np.int64)}
    for slot in pipe.slots:
        suffix = slot.name[len("text_encoder"):]
        feeds[f"input_ids{suffix}"] = pipe.tokenizers[slot.name](["a blue star"])
        feeds[f"uncond_input_ids{suffix}"] = pipe.tokenizers[slot.name](["a red ring"])
    sess = ort.InferenceSession(str(sd3_loops / "sampler_loop_whole" / "model.onnx"), providers=["CPUExecutionProvider"])
    image = sess.run(["image"], feeds)[0]
    assert image.dtype == np.uint8 and image.shape == host.images.shape
    assert psnr(image, host.images) >= 59


def pipe_options(**kw):
    from onnxdiffusion.runtime.pipeline import GenerateOptions

    return GenerateOptions(sampler="flow_euler", **kw)


def test_epsilon_sampler_on_flow_model_is_refused(tiny_sd3_onnx, tmp_path):
    proc = run_cli_here("generate", tiny_sd3_onnx, PROMPT, "--steps", 2, "--sampler", "ddim", "-o", tmp_path / "x.png")
    assert_one_line_error(proc)


def test_folder_exported_with_t5_needs_it(tiny_sd3_onnx, tmp_path):
    import shutil

    from onnxdiffusion.folder.artifacts import hash_tree, write_json

    dst = tmp_path / "model"
    shutil.copytree(tiny_sd3_onnx, dst)
    shutil.rmtree(dst / "text_encoder_3")
    m = json.loads((dst / "manifest.json").read_text())
    del m["components"]["text_encoder_3"]
    m["files"] = hash_tree(dst)
    write_json(dst / "manifest.json", m)
    proc = run_cli_here("generate", dst, PROMPT, "--steps", 1, "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "sd3", "text_encoder_3")
