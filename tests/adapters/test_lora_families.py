"""Run-time LoRA on SDXL, SD3 and Flux (acceptance 1): insertion points keep each family's plain image exactly, and
random peft LoRAs (one at 0.7; one with text-encoder layers; two at once) match diffusers' load_lora_weights +
set_adapters, in the host loop, the Loop and unrolled graphs (adapter tensors as graph inputs, outer-scope in the
Loop body) and the --whole graph (text encoders' layers inside it too)."""

import numpy as np
import pytest

from lora_helpers import diffusers_lora_images, make_lora, run_whole_graph
from onnxdiffusion.adapters.folder import add_points
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"
FAMILIES = {"sdxl": ("tiny_sdxl_diffusers", "tiny_sdxl_onnx"), "sd3": ("tiny_sd3_diffusers", "tiny_sd3_onnx"),
            "flux": ("tiny_flux_diffusers", "tiny_flux_onnx")}
CASES = {"one at 0.7": [("plain", 0.7)], "text encoder layers": [("text", 1.0)],
         "two at once": [("plain", 0.7), ("text", 0.5)]}
STEPS = {"flux": 4}  # others 5


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    src_name, onnx_name = FAMILIES[request.param]
    src, folder = request.getfixturevalue(src_name), request.getfixturevalue(onnx_name)
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    points = root / "points"
    add_points(folder, points)
    compile_loop(points, points, form="loop")  # in place: sampler_* components beside the plain ones
    compile_loop(points, points, form="unrolled", steps=STEPS.get(request.param, 5))
    compile_loop(points, points, form="loop", whole=True)
    loras = {"plain": make_lora(src, root / "plain", seed=11, std=0.2),
             "text": make_lora(src, root / "text", seed=12, rank=8, alpha=4, text=True, std=0.2)}
    return request.param, src, folder, root / "points", loras


def _generate(pipe, name, loras=None, **kw):
    if name == "flux":  # guidance-distilled: the scale is an input
        return pipe(PROMPT, steps=4, guidance=3.5, seed=2, loras=loras, height=32, width=32, **kw)
    return pipe(PROMPT, steps=5, guidance=5.0, seed=2, loras=loras, height=32, width=32, **kw)


def _reference(name, src, pipe, loras, latents):
    call = {"max_sequence_length": pipe.info["max_lengths"]["text_encoder_2"]} if name == "flux" else {}
    steps, guidance = (4, 3.5) if name == "flux" else (5, 5.0)
    return diffusers_lora_images(src, loras, PROMPT, latents, steps, guidance, (32, 32), **call)


def test_points_keep_the_plain_image_exactly(family):
    name, _, folder, points, _ = family
    a = _generate(Pipeline.from_folder(folder), name)
    b = _generate(Pipeline.from_folder(points), name)
    np.testing.assert_array_equal(a.latents, b.latents)
    np.testing.assert_array_equal(a.images, b.images)


@pytest.mark.parametrize("case", list(CASES))
def test_runtime_lora_matches_diffusers(family, case):
    name, src, _, points, files = family
    loras = [(files[n], w) for n, w in CASES[case]]
    pipe = Pipeline.from_folder(points)
    plain = _generate(pipe, name)
    ours = _generate(pipe, name, loras)
    ref = _reference(name, src, pipe, loras, ours.init_latents)
    assert psnr(ours.images, ref) >= 40.0, name
    assert psnr(ours.images, plain.images) < 37.0  # the LoRA visibly changes the image
    for form in ("loop", "unrolled"):  # the backbone's adapter inside the graph, text encoders' on the host
        graph = _generate(pipe, name, loras, loop=form)
        assert np.linalg.norm(graph.latents - ours.latents) <= 1e-4 * np.linalg.norm(ours.latents), form
        assert psnr(graph.images, ours.images) >= 60.0, form
        assert psnr(graph.images, ref) >= 40.0, form


def test_fused_lora_matches_diffusers(family, tmp_path):
    """export --lora (two at once, one with text-encoder layers) against diffusers with both loaded."""
    import json

    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.families import family_for_pipeline

    name, src, _, _, files = family
    loras = [(files["plain"], 0.7), (files["text"], 0.5)]
    fam = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"])
    names = (*(s.name for s in fam.text_encoders), fam.backbone, "vae_decoder")
    out = tmp_path / "fused"
    export_pipeline(src, out, ExportOptions(components=names, default_size=32, loras=tuple(loras)), progress=False)
    pipe = Pipeline.from_folder(out)
    ours = _generate(pipe, name)
    ref = _reference(name, src, pipe, loras, ours.init_latents)
    assert psnr(ours.images, ref) >= 40.0, name


def test_whole_graph_runs_text_encoder_layers(family):
    """--whole: token ids in, image out, the LoRA's text-encoder and backbone layers both graph inputs
    (sampling_graph_inputs names them); same image as the host loop with the same adapters."""
    import onnxruntime as ort

    from onnxdiffusion.adapters.runtime import sampling_graph_inputs

    name, _, _, points, files = family
    pipe = Pipeline.from_folder(points)
    steps, guidance = (4, 3.5) if name == "flux" else (5, 5.0)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # one warning per overridable initializer otherwise
    sess = ort.InferenceSession(str(points / "sampler_loop_whole" / "model.onnx"), options,
                                providers=["CPUExecutionProvider"])
    images = {}
    for given in (None, [(files["plain"], 0.7), (files["text"], 0.5)], [(files["text"], 1.0)]):
        host = _generate(pipe, name, given, negative_prompt="a green ring")
        extra = sampling_graph_inputs(pipe, given)
        assert any(k.startswith("text_encoder") for k in extra) == (given is not None)
        images[str(given)] = run_whole_graph(sess, pipe, host, PROMPT, "a green ring", steps, guidance, extra)
        assert psnr(images[str(given)], host.images) >= 60.0, given
    assert len({im.tobytes() for im in images.values()}) == 3  # each adapter set changes the image
