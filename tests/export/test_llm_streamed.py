"""LLM text encoders exported streamed from their shards (export/llm_streamed.py, issue 43): float == the whole-model
export on tiny Z-Image (Qwen3), Qwen-Image (Qwen2.5-VL) and FLUX.2 [klein] (Qwen3ForCausalLM, three layers read;
4 layers deep here) pipelines, int8 / int4 within a stated distance of float on tiny Qwen3 and Qwen2.5-VL text models
wide enough for blocks of 32, the pipelines' images unchanged in float, the int8 folder generating through the run time unchanged, the manifest's record, and one-line refusals."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.export import ExportOptions, export_pipeline
from onnxdiffusion.export.gguf_blocks import nbits_to_float, requantize4
from onnxdiffusion.export.safetensors_shards import Shards

TE = ExportOptions(components=("text_encoder",))
# hidden-state SNR vs the float export, random N(0, 0.02) weights (measured 37.9 / 17.4 dB on the Qwen3 below)
MIN_SNR_DB = {"int8": 32.0, "int4": 14.0}


def _encode(folder: Path, vocab: int) -> np.ndarray:
    sess = ort.InferenceSession(str(folder / "text_encoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(1, vocab, (2, 20))
    mask = np.ones_like(ids)
    mask[1, 14:] = 0
    return sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.square(ref - got, dtype=np.float64).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float(np.square(ref, dtype=np.float64).sum()) / noise)


def _shallow_klein(src: Path, out: Path, monkeypatch) -> Path:
    """The tiny [klein] pipeline with a 4-layer encoder that the family reads at layers 1, 2 and 3 instead of a
    28-layer one read at 9, 18 and 27: the same shape of problem (three reads, the last layer unread, more layers
    than the cut-down copy keeps, so its repeated layers are exercised) at a seventh of the tracing, which was
    nearly all of this case's time (two traces of 28 layers, ~19 s)."""
    import transformers

    from onnxdiffusion.families.flux2 import Flux2Klein

    shutil.copytree(src, out)
    config = transformers.Qwen3Config.from_pretrained(out / "text_encoder")
    config.num_hidden_layers, config.layer_types = 4, config.layer_types[:4]
    shutil.rmtree(out / "text_encoder")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(out / "text_encoder")
    monkeypatch.setattr(Flux2Klein, "text_layers", (1, 2, 3))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zimage", "qwenimage", "flux2_klein"])
def test_streamed_float_is_the_whole_export(request, tmp_path, kind, monkeypatch):
    """The session's folder (stream_weights "auto": whole at the tiny sizes) vs the encoder exported streamed;
    [klein] on a shallower encoder, its whole export made here (text encoder only)."""
    src = request.getfixturevalue(f"tiny_{kind}_diffusers")
    if kind == "flux2_klein":
        src = _shallow_klein(src, tmp_path / "src", monkeypatch)
        whole_folder = tmp_path / "whole"
        export_pipeline(src, whole_folder, TE, progress=False)
    else:
        whole_folder = request.getfixturevalue(f"tiny_{kind}_onnx")
    streamed = export_pipeline(src, tmp_path / "streamed", replace(TE, stream_weights="on"), progress=False)
    assert "streamed_weights" not in json.loads((whole_folder / "manifest.json").read_text())["components"]["text_encoder"]
    entry = streamed.to_dict()["components"]["text_encoder"]
    assert entry["streamed_weights"] is True and entry["precision"] == "fp32"
    assert entry["weights"] == {"linear": "fp32", "embedding": "fp32"}
    assert entry["validation"]["scope"].startswith("cut-down copy")
    model = onnx.load(str(tmp_path / "streamed" / "text_encoder" / "model.onnx"), load_external_data=False)
    assert {n.domain for n in model.graph.node} <= {"", "com.microsoft"}
    ref, got = _encode(whole_folder, 300), _encode(tmp_path / "streamed", 300)
    assert np.abs(ref - got).max() <= 1e-6 * max(1.0, float(np.abs(ref).max()))


def _wide(src: Path, out: Path, kind: str) -> Path:
    """The tiny pipeline with a text encoder 64 wide (blocks of 32 fit) and the backbone's text width to match."""
    import transformers

    shutil.copytree(src, out)
    shutil.rmtree(out / "text_encoder")
    torch.manual_seed(0)
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6)
    if kind == "zimage":
        model = transformers.Qwen3Model(transformers.Qwen3Config(head_dim=16, **text))
        key = "cap_feat_dim"
    else:
        cfg = transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                               fullatt_block_indexes=[0], window_size=16, patch_size=14, temporal_patch_size=2),
            vocab_size=512, hidden_size=64)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
        key = "joint_attention_dim"
    model.save_pretrained(out / "text_encoder")
    path = out / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: 64}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zimage", "qwenimage"])
def test_int8_int4_within_stated_db_of_float(request, tmp_path, kind):
    src = _wide(request.getfixturevalue(f"tiny_{kind}_diffusers"), tmp_path / "src", kind)
    outs = {}
    for weights in ("float", "int8", "int4"):
        m = export_pipeline(src, tmp_path / weights, replace(TE, text_encoder_weights=weights, stream_weights="on"),
                            progress=False)
        entry = m.to_dict()["components"]["text_encoder"]
        assert entry["precision"] == ("fp32" if weights == "float" else weights)
        assert entry["validation"]["max_abs_error"] <= entry["validation"]["atol"]  # vs its own dequantized weights
        outs[weights] = _encode(tmp_path / weights, 320)
    model = onnx.load(str(tmp_path / "int4" / "text_encoder" / "model.onnx"), load_external_data=False)
    assert {"MatMulNBits", "GatherBlockQuantized"} <= {n.op_type for n in model.graph.node}
    floats = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert max(int(np.prod(i.dims)) for i in floats) < 64 * 64  # no float weight left (64 x 64 the smallest)
    for weights, floor in MIN_SNR_DB.items():
        assert _snr_db(outs["float"], outs[weights]) >= floor, weights


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zimage", "qwenimage"])
def test_streamed_encoder_gives_the_whole_exports_image(request, kind):
    """conftest's folder (stream_weights "auto": whole, as the tiny sizes are) vs one exported streamed (conftest's
    export_family with stream_weights "on", once per run: test_streamed_float reads the Z-Image one too)."""
    from onnxdiffusion.runtime import Pipeline

    streamed = request.getfixturevalue(f"tiny_{kind}_streamed_onnx")
    assert json.loads((streamed / "manifest.json").read_text())["components"]["text_encoder"]["streamed_weights"]
    images = [Pipeline.from_folder(f, threads=1)("a red circle", steps=2, seed=1, height=32, width=32).images.astype(int)
              for f in (request.getfixturevalue(f"tiny_{kind}_onnx"), streamed)]
    assert np.abs(images[0] - images[1]).max() <= 1


@pytest.mark.slow
def test_int8_encoder_folder_generates(tiny_zimage_diffusers, tmp_path):
    from onnxdiffusion.runtime import Pipeline

    src = _wide(tiny_zimage_diffusers, tmp_path / "src", "zimage")
    # the backbone's text width changed: its weights are re-drawn to match
    from diffusers import ZImageTransformer2DModel

    ZImageTransformer2DModel.from_config(ZImageTransformer2DModel.load_config(src / "transformer")) \
        .save_pretrained(src / "transformer")
    images = {}
    for weights in ("float", "int8"):
        out = tmp_path / weights
        export_pipeline(src, out, ExportOptions(skip=("vae_encoder",), default_size=32, text_encoder_weights=weights),
                        progress=False)
        images[weights] = Pipeline.from_folder(out, threads=1)("a red circle", steps=2, seed=1).images.astype(float)
    assert images["int8"].shape == images["float"].shape
    mse = np.mean((images["int8"] - images["float"]) ** 2)
    assert mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 30


@pytest.mark.slow
def test_bad_weights_and_no_llm_refused(tiny_zimage_diffusers, tiny_diffusers, tmp_path):
    with pytest.raises(UserError, match="text-encoder-weights"):
        export_pipeline(tiny_zimage_diffusers, tmp_path / "a", replace(TE, text_encoder_weights="int3"), progress=False)
    with pytest.raises(UserError, match="no LLM text encoder"):
        export_pipeline(tiny_diffusers, tmp_path / "b", ExportOptions(text_encoder_weights="int8"), progress=False)
    with pytest.raises(UserError, match="multiple of 32"):  # the tiny encoder is 24 wide
        export_pipeline(tiny_zimage_diffusers, tmp_path / "c", replace(TE, text_encoder_weights="int4"), progress=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_rows_read_alone_are_the_tables_rows(tiny_zimage_diffusers):
    shards = Shards(tiny_zimage_diffusers / "text_encoder")
    name = next(n for n in shards.entries if n.endswith("embed_tokens.weight"))
    whole = shards.read(name)
    assert np.array_equal(shards.read(name, (5, 9)), whole[5:9])
    assert np.array_equal(shards.read(name, (len(whole) - 2, len(whole) + 5)), whole[-2:])


def test_requantize4_rounds_to_q4_0_levels():
    w = np.random.default_rng(0).normal(0, 0.02, (16, 64)).astype(np.float32)
    nb = requantize4(w)
    back = nbits_to_float(nb, w.shape)
    step = np.repeat(nb.scales.reshape(16, 2), 32, axis=1)
    assert np.all(np.abs(back - w) <= np.abs(step) * 1.0 + 1e-9)  # within one level (the +8 side clips to +7)
    assert nb.snr_db > 18
