"""SDXL end to end: export -> generate against diffusers' StableDiffusionXLPipeline, loop forms, quantize."""

import json

import numpy as np
import pytest
from family_pipelines import diffusers_images
from PIL import Image

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.folder.artifacts import hash_tree, write_json
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import Pipeline

PROMPT = "a red circle on the left"
SIZE = (32, 32)


@pytest.mark.slow
def test_manifest_records_family_and_per_component_validation(tiny_sdxl_onnx):
    m = json.loads((tiny_sdxl_onnx / "manifest.json").read_text())
    assert m["family"] == "sdxl"
    assert set(m["components"]) == {"text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder"}
    for name, comp in m["components"].items():
        assert comp["family"] == "sdxl"
        v = comp["validation"]
        assert v["max_abs_error"] <= v["atol"], name
    unet_inputs = [i["name"] for i in m["components"]["unet"]["inputs"]]
    assert unet_inputs == ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    # the second tokenizer pads with "!" (as SDXL's does) and the run time reads that
    assert json.loads((tiny_sdxl_onnx / "tokenizer_2" / "tokenizer_config.json").read_text())["pad_token"] == "!"


# (sampler, negative prompt): None exercises force_zeros_for_empty_prompt (zero uncond embeddings)
CASES = [("euler", None), ("ddim", "a green ring"), ("euler_a", None), ("dpmpp_2m", "a green ring")]


@pytest.mark.slow
@pytest.mark.parametrize("sampler, negative", CASES)
def test_matches_diffusers(tiny_sdxl_diffusers, tiny_sdxl_onnx, sampler, negative):
    pipe = Pipeline.from_folder(tiny_sdxl_onnx)
    ours = pipe(PROMPT, negative_prompt=negative, steps=5, sampler=sampler, guidance=5.0, seed=3, batch=2)
    ref = diffusers_images(tiny_sdxl_diffusers, [PROMPT] * 2, ours.init_latents, 5, 5.0, sampler=sampler,
                           noise=ours.noise, negative=None if negative is None else [negative] * 2, image_size=SIZE)
    assert psnr(ours.images, ref) >= 40.0


@pytest.mark.slow
def test_cli_generate_matches_diffusers(tiny_sdxl_diffusers, tiny_sdxl_onnx, tmp_path):
    """The `generate` verb (seeded latents) against diffusers from the same latents."""
    out = tmp_path / "img.png"
    proc = run_cli_here("generate", tiny_sdxl_onnx, PROMPT, "--steps", 4, "--sampler", "euler", "--seed", 11,
                   "--guidance", 4.0, "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    latents = np.random.default_rng(11).standard_normal((1, 4, 8, 8), dtype=np.float32)
    ref = diffusers_images(tiny_sdxl_diffusers, PROMPT, latents, 4, 4.0, sampler="euler", image_size=SIZE)
    assert psnr(np.asarray(Image.open(out))[None], ref) >= 40.0


@pytest.fixture(scope="module")
def sdxl_loops(tiny_sdxl_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("sdxl_loops") / "model"
    compile_loop(tiny_sdxl_onnx, out, form="loop")
    compile_loop(out, out, form="unrolled", steps=4)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sampler, negative", [("ddim", None), ("euler_a", "a green ring"), ("dpmpp_2m", None)])
def test_loop_forms_match_host(sdxl_loops, sampler, negative):
    pipe = Pipeline.from_folder(sdxl_loops)
    kw = dict(negative_prompt=negative, steps=4, sampler=sampler, guidance=5.0, seed=4, batch=2)
    host = pipe(PROMPT, **kw)
    for form in ("loop", "unrolled"):
        got = pipe(PROMPT, loop=form, **kw)
        assert psnr(got.images, host.images) >= 60, form
        assert np.linalg.norm(got.latents - host.latents) / np.linalg.norm(host.latents) < 1e-4, form


# -- bad input ------------------------------------------------------------------------------------

def _relabel(folder, tmp_path, edit):
    import shutil

    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    m["files"] = hash_tree(dst)
    write_json(dst / "manifest.json", m)
    return dst


@pytest.mark.slow
def test_unknown_family_is_one_line_error(tiny_sdxl_onnx, tmp_path):
    dst = _relabel(tiny_sdxl_onnx, tmp_path, lambda m: m.update(family="kandinsky"))
    proc = run_cli_here("generate", dst, PROMPT, "--steps", 1, "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "unknown model family", "kandinsky")


@pytest.mark.slow
def test_components_of_different_families_mixed(tiny_sdxl_onnx, tiny_onnx, tmp_path):
    """An SD UNet dropped into an SDXL folder: refused by name, not run."""
    import shutil

    def swap(m):
        sd = json.loads((tiny_onnx / "manifest.json").read_text())
        m["components"]["unet"] = sd["components"]["unet"]

    dst = _relabel(tiny_sdxl_onnx, tmp_path, swap)
    shutil.rmtree(dst / "unet")
    shutil.copytree(tiny_onnx / "unet", dst / "unet")
    m = json.loads((dst / "manifest.json").read_text())
    m["files"] = hash_tree(dst)
    write_json(dst / "manifest.json", m)
    with pytest.raises(UserError, match="different families mixed"):
        Pipeline.from_folder(dst)


@pytest.mark.slow
def test_missing_required_encoder_in_model_folder(tiny_sdxl_onnx, tmp_path):
    dst = _relabel(tiny_sdxl_onnx, tmp_path, lambda m: m["components"].pop("text_encoder_2"))
    proc = run_cli_here("generate", dst, PROMPT, "--steps", 1, "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "sdxl", "text_encoder_2")


def test_export_refuses_mixed_source(tiny_sdxl_diffusers, tiny_diffusers, tmp_path):
    """An SDXL source whose unet is SD's (no added conditioning): refused before any export."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_sdxl_diffusers, src)
    shutil.rmtree(src / "unet")
    shutil.copytree(tiny_diffusers / "unet", src / "unet")
    proc = run_cli_here("export", src, tmp_path / "out")
    assert_one_line_error(proc, "text_time")
    assert not (tmp_path / "out").exists()
