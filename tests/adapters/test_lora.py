"""LoRA: insertion points keep the plain image bit for bit; run-time and fused LoRAs match diffusers'
load_lora_weights + set_adapters; kohya files convert; bad input is one line and writes nothing."""

import json

import numpy as np
import pytest

from lora_helpers import diffusers_lora_images, make_lora
from onnxdiffusion.adapters.folder import add_points
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"
KW = dict(steps=6, seed=3, guidance=5.0)


@pytest.fixture(scope="module")
def sd_loras(tiny_diffusers, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"plain": make_lora(tiny_diffusers, root / "plain", seed=1),
            "text": make_lora(tiny_diffusers, root / "text", seed=2, rank=8, alpha=4, text=True)}


@pytest.fixture(scope="module")
def sd_points(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("points") / "model"
    add_points(tiny_onnx, out)
    return out


CASES = {"one at 0.7": [("plain", 0.7)], "text encoder layers": [("text", 1.0)], "two at once": [("plain", 0.7), ("text", 0.5)]}


def test_points_keep_the_plain_image_exactly(tiny_onnx, sd_points):
    manifest = json.loads((sd_points / "manifest.json").read_text())
    targets = manifest["components"]["unet"]["lora"]["targets"]
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" in targets
    assert targets["down_blocks.0.attentions.0.proj_in"]["op"] == "conv"  # 1x1 conv in SD's UNet
    assert "text_model.encoder.layers.0.self_attn.q_proj" in manifest["components"]["text_encoder"]["lora"]["targets"]
    a = Pipeline.from_folder(tiny_onnx)(PROMPT, **KW)
    b = Pipeline.from_folder(sd_points)(PROMPT, **KW)
    np.testing.assert_array_equal(a.latents, b.latents)
    np.testing.assert_array_equal(a.images, b.images)


@pytest.mark.parametrize("case", list(CASES))
def test_runtime_lora_matches_diffusers(tiny_diffusers, sd_points, sd_loras, case):
    loras = [(sd_loras[n], w) for n, w in CASES[case]]
    pipe = Pipeline.from_folder(sd_points)
    plain = pipe(PROMPT, **KW)
    ours = pipe(PROMPT, loras=loras, **KW)
    ref = diffusers_lora_images(tiny_diffusers, loras, PROMPT, ours.init_latents, KW["steps"], KW["guidance"], (32, 32))
    assert psnr(ours.images, ref) >= 40.0
    assert psnr(ours.images, plain.images) < 37.0  # the LoRA visibly changes the image
    again = pipe(PROMPT, **KW)  # and leaves nothing behind
    np.testing.assert_array_equal(again.images, plain.images)


def test_adapter_step_is_bound_and_equals_fed_run(sd_points, sd_loras):
    """The backbone step binds the adapter's arrays (the set's merged weights, adapters/fused.py) on its IO binding
    (runtime/backbone.FedBackbone): the same output as feeding them to run(); in the points graph (compiled
    sampling graphs) a 1x1 conv's branch is MatMuls (no Conv with a fed weight)."""
    import onnx

    from onnxdiffusion.runtime.backbone import FedBackbone
    from onnxdiffusion.families.base import OUT, SAMPLE, TIMESTEP
    from onnxdiffusion.samplers import cfg_combine

    pipe = Pipeline.from_folder(sd_points)
    adapter = pipe.lora_feeds([(sd_loras["plain"], 0.7)])
    shape = pipe.latent_shape_for(1)
    step = pipe.guided_backbone([PROMPT], None, KW["guidance"], 32, 32, shape, adapter=adapter)
    assert isinstance(step, FedBackbone) and step.adapter
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    out = step(x, 500.0)
    feeds = {SAMPLE: step.sample, TIMESTEP: step.timestep, **step.conditioning, **step.adapter}
    raw = step.session.run([OUT], feeds)[0]
    np.testing.assert_array_equal(out, cfg_combine(raw[:1], raw[1:], KW["guidance"], rescale=step.rescale))
    graph = onnx.load(str(sd_points / "unet" / "model.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node if n.name.startswith("/lora/down_blocks.0.attentions.0.proj_in/")}
    assert "MatMul" in ops and "Conv" not in ops


def test_fused_lora_matches_diffusers(tiny_diffusers, sd_loras, tmp_path):
    from onnxdiffusion.export import ExportOptions, export_pipeline

    loras = [(sd_loras["plain"], 0.7), (sd_loras["text"], 0.5)]
    out = tmp_path / "fused"
    manifest = export_pipeline(tiny_diffusers, out, ExportOptions(loras=tuple(loras), skip=("vae_encoder",)), progress=False)
    assert [r["scale"] for r in manifest["lora_fused"]] == [0.7, 0.5]
    ours = Pipeline.from_folder(out)(PROMPT, **KW)
    ref = diffusers_lora_images(tiny_diffusers, loras, PROMPT, ours.init_latents, KW["steps"], KW["guidance"], (32, 32))
    assert psnr(ours.images, ref) >= 40.0


def test_int8_backbone_points_and_lora(tiny_onnx, sd_loras, tmp_path):
    """On ORT's fused int8 kernels: no adapter = the int8 image exactly; with one, the merged weights are
    requantized on the recipe's grid and the int8 + LoRA image follows the fp32 + LoRA image. Attention int8
    (the recipe's `auto` picks it when it times faster): the q/k/v projections are QLinearMatMuls (int8 out) and
    keep a point too (a branch that requantizes its sum at the output's scale)."""
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class

    q = tmp_path / "int8"
    recipe = recipe_class("int8-static").with_options({"attention": "int8"})
    quantize(tiny_onnx, q, QuantizeConfig(recipe=recipe, calibration=CalibrationConfig(
        count=4, steps=3, batch=4), latency_runs=1, measure_memory=False))
    add_points(q, tmp_path / "int8_points")
    add_points(tiny_onnx, tmp_path / "fp32_points")
    manifest = json.loads((tmp_path / "int8_points" / "manifest.json").read_text())
    fp32 = json.loads((tmp_path / "fp32_points" / "manifest.json").read_text())
    assert manifest["components"]["unet"]["lora"]["targets"] == fp32["components"]["unet"]["lora"]["targets"]
    a = Pipeline.from_folder(q)(PROMPT, **KW)
    pipe = Pipeline.from_folder(tmp_path / "int8_points")
    np.testing.assert_array_equal(pipe(PROMPT, **KW).images, a.images)
    loras = [(sd_loras["plain"], 0.7)]
    ours = pipe(PROMPT, loras=loras, **KW)
    # merged at switch (adapters/fused.py) on the integer kernels; the time embedding's QGemms keep their branch
    assert {layer.kind for layer in pipe.lora.fused.layers.values()} == {"matmul_int8", "conv_int8"}
    assert len(pipe.lora.fused.layers) < len(manifest["components"]["unet"]["lora"]["targets"])
    ref = Pipeline.from_folder(tmp_path / "fp32_points")(PROMPT, loras=loras, **KW)
    assert psnr(ours.images, ref.images) >= 30.0
    assert psnr(ours.images, a.images) < psnr(ours.images, ref.images)  # nearer fp32+LoRA than plain int8


def test_kohya_file_converts_and_matches_diffusers(tiny_diffusers, tiny_onnx, sd_points, sd_loras, tmp_path):
    import safetensors.torch as st
    from diffusers.utils import convert_state_dict_to_kohya

    from onnxdiffusion.adapters.convert import convert_lora

    kohya = tmp_path / "kohya.safetensors"
    st.save_file(convert_state_dict_to_kohya(st.load_file(sd_loras["text"])), kohya)
    pipe = Pipeline.from_folder(sd_points)
    with pytest.raises(UserError, match="kohya.*lora convert"):
        pipe(PROMPT, loras=[(kohya, 1.0)], **KW)
    converted = tmp_path / "converted.safetensors"
    assert convert_lora(kohya, converted, tiny_onnx) > 0
    ours = pipe(PROMPT, loras=[(converted, 0.8)], **KW)
    ref = diffusers_lora_images(tiny_diffusers, [(kohya, 0.8)], PROMPT, ours.init_latents, KW["steps"], KW["guidance"], (32, 32))
    assert psnr(ours.images, ref) >= 40.0


@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_loop_forms_take_the_adapter_as_inputs(sd_points, sd_loras, tmp_path, form):
    """compile-loop on a folder with points: the graph runs the plain image without an adapter and the LoRA
    image with one, each as the host loop does."""
    import shutil

    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(sd_points, folder)
    compile_loop(folder, folder, form=form, steps=KW["steps"] if form == "unrolled" else None)
    pipe = Pipeline.from_folder(folder)
    loras = [(sd_loras["plain"], 0.7), (sd_loras["text"], 0.5)]
    for given in (None, loras):
        host = pipe(PROMPT, loras=given, **KW)
        graph = pipe(PROMPT, loras=given, loop=form, **KW)
        assert psnr(graph.images, host.images) >= 60.0, given
    plain = pipe(PROMPT, loop=form, **KW)
    assert psnr(graph.images, plain.images) < 37.0


def test_whole_graph_takes_text_encoder_layers(sd_points, sd_loras, tmp_path):
    """--whole inlines the text encoder: its insertion points are graph inputs too, named by
    sampling_graph_inputs; a graph that leaves the text encoder to the host refuses such a LoRA in one line."""
    import shutil

    import onnxruntime as ort

    from lora_helpers import run_whole_graph
    from onnxdiffusion.adapters.runtime import sampling_graph_inputs
    from onnxdiffusion.loopgraph.compile import compile_loop

    folder = tmp_path / "model"
    shutil.copytree(sd_points, folder)
    compile_loop(folder, folder, form="loop")
    info = compile_loop(folder, folder, form="loop", whole=True)
    assert set(info["lora"]["components"]) == {"unet", "text_encoder"}
    pipe = Pipeline.from_folder(folder)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(folder / "sampler_loop_whole" / "model.onnx"), options,
                                providers=["CPUExecutionProvider"])
    loras = [(sd_loras["plain"], 0.7), (sd_loras["text"], 0.5)]
    for given in (None, loras, [(sd_loras["text"], 1.0)]):
        host = pipe(PROMPT, negative_prompt="a green ring", loras=given, **KW)
        image = run_whole_graph(sess, pipe, host, PROMPT, "a green ring", KW["steps"], KW["guidance"],
                                sampling_graph_inputs(pipe, given))
        assert psnr(image, host.images) >= 60.0, given
    assert sampling_graph_inputs(pipe, [(sd_loras["plain"], 0.7)], "sampler_loop")  # backbone layers only: fine
    with pytest.raises(UserError, match="does not run the LoRA's text_encoder layers"):
        sampling_graph_inputs(pipe, loras, "sampler_loop")
    with pytest.raises(UserError, match="no sampling graph 'unet'"):
        sampling_graph_inputs(pipe, loras, "unet")


def test_runtime_lora_imports_no_torch(sd_points, sd_loras):
    import subprocess
    import sys

    code = ("import sys\nfrom onnxdiffusion.runtime import Pipeline\n"
            "r = Pipeline.from_folder(sys.argv[1])('a red circle', steps=2, loras=[(sys.argv[2], 0.7)])\n"
            "print('HEAVY', sorted(m for m in ('torch', 'diffusers', 'transformers', 'safetensors') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(sd_points), str(sd_loras["text"])], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_export_lora_points_equals_lora_points_verb(tiny_diffusers, tiny_onnx, sd_points, tmp_path):
    from cli_helpers import invoke

    out = tmp_path / "exported"
    proc = invoke("export", tiny_diffusers, out, "--lora-points", "linear", "--skip", "vae_encoder", timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((out / "manifest.json").read_text())["components"]
    want = json.loads((sd_points / "manifest.json").read_text())["components"]
    for name in ("unet", "text_encoder"):
        assert got[name]["lora"] == want[name]["lora"], name
    np.testing.assert_array_equal(Pipeline.from_folder(out)(PROMPT, **KW).images,
                                  Pipeline.from_folder(tiny_onnx)(PROMPT, **KW).images)
