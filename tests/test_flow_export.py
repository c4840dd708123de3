"""Flux and Qwen-Image components: export fix-ups and per-component parity with PyTorch.

Each component is exported with the project's `export_component` (validation included) at two
shapes that differ in batch, image tokens and text tokens, so every named axis is proven dynamic.
"""

from __future__ import annotations

import collections
import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.export.components import ComponentSpec, TensorSpec, _VaeDecoder
from onnxdiffusion.export.fixups import decompose_rms_norms, exact_nearest_upsamples
from onnxdiffusion.export.flow_components import (
    decoder_hidden_states_spec, encoder_hidden_states_spec, flux_transformer_spec, qwenimage_transformer_spec,
)
from onnxdiffusion.export.pipeline import ExportOptions
from onnxdiffusion.export.rope import qwen_image_ids, rotate_pairs
from onnxdiffusion.export.validate import export_component
from onnxdiffusion.families import latents as lat

OPTS = ExportOptions()


@pytest.fixture(scope="module")
def flux(tiny_flux_diffusers):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_flux_diffusers)


@pytest.fixture(scope="module")
def qwen(tiny_qwenimage_diffusers):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_qwenimage_diffusers)


def test_rotate_pairs_is_the_complex_rotation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 8, generator=g)
    angle = torch.randn(7, 4, generator=g)
    want = torch.view_as_real(torch.view_as_complex(x.reshape(2, 7, 3, 4, 2)) * torch.polar(torch.ones_like(angle), angle)[None, :, None])
    got = rotate_pairs(x, torch.cos(angle), torch.sin(angle))
    assert torch.allclose(got, want.flatten(3), atol=1e-6)


def test_rms_norm_decomposed_exports_and_ort_fuses_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.RMSNorm(16, eps=1e-6)).eval()
    x = torch.randn(2, 5, 16)
    ref = model(x)
    assert decompose_rms_norms(model) == 1
    assert torch.allclose(model(x), ref, atol=1e-6)
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b", 1: "s"}}, opset_version=17, dynamo=False)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    assert ops["SimplifiedLayerNormalization"] == 1 and ops["Pow"] == 0
    x2 = torch.randn(1, 3, 16)
    with torch.no_grad():
        np.testing.assert_allclose(sess.run(None, {"x": x2.numpy()})[0], model(x2).numpy(), atol=1e-5)


def test_nearest_exact_swap_is_exact_for_integer_factors():
    up = torch.nn.Sequential(torch.nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                             torch.nn.Upsample(scale_factor=1.5, mode="nearest-exact"))
    x = torch.randn(1, 2, 5, 7)
    ref = up[0](x)
    assert exact_nearest_upsamples(up) == 1  # the 1.5x layer is left alone
    assert up[1].mode == "nearest-exact"
    assert torch.equal(up[0](x), ref)


def test_flux_transformer_export(flux, tmp_path):
    original = flux.transformer.eval()
    model = copy.deepcopy(original)
    assert decompose_rms_norms(model) > 0  # Flux's q/k norms are torch.nn.RMSNorm
    spec = flux_transformer_spec(16, 32, 32, guidance=True)
    wrapped = spec.wrap(model).eval()
    g = torch.Generator().manual_seed(0)

    def feeds(batch, rows, cols, text):
        return {
            "hidden_states": torch.randn(batch, rows * cols, 16, generator=g),
            "encoder_hidden_states": torch.randn(batch, text, 32, generator=g),
            "pooled_projections": torch.randn(batch, 32, generator=g),
            "timestep": torch.rand(batch, generator=g),
            "img_ids": torch.from_numpy(lat.image_ids(rows, cols)),
            "txt_ids": torch.from_numpy(lat.text_ids(text, None)),
            "guidance": torch.full((batch,), 3.5),
        }

    feed_list = [feeds(2, 8, 8, 16), feeds(1, 6, 10, 12)]
    with torch.no_grad():  # the rewritten attention is diffusers' own attention
        for f in feed_list:
            ref = original(**f, return_dict=False)[0]
            assert torch.allclose(wrapped(**f), ref, atol=1e-5)
    info = export_component(spec, wrapped, feed_list, tmp_path / "transformer", OPTS)
    assert info["validation"]["max_rel_error"] < 1e-4


def test_t5_encoder_export(flux, tmp_path):
    spec = encoder_hidden_states_spec("text_encoder_2", 32)
    g = torch.Generator().manual_seed(1)
    vocab = flux.text_encoder_2.config.vocab_size
    feed_list = [{"input_ids": torch.randint(0, vocab, (2, 16), generator=g)},
                 {"input_ids": torch.randint(0, vocab, (1, 9), generator=g)}]
    info = export_component(spec, spec.wrap(flux.text_encoder_2.eval()).eval(), feed_list, tmp_path / "t5", OPTS)
    assert info["validation"]["max_rel_error"] < 1e-4


def _qwen_feeds(g, batch, rows, cols, text, pad=0):
    mask = torch.ones(batch, text, dtype=torch.int64)
    if pad:
        mask[0, text - pad:] = 0
    return {
        "hidden_states": torch.randn(batch, rows * cols, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, 16, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(batch, generator=g),
        "img_ids": torch.from_numpy(lat.image_ids(rows, cols, centred=True)),
        "txt_ids": torch.from_numpy(lat.text_ids(text, max(rows // 2, cols // 2))),
    }


def test_qwenimage_transformer_export_real_rotary_and_text_mask(qwen, tmp_path):
    original = qwen.transformer.eval()
    spec = qwenimage_transformer_spec(16, 16, 16)
    wrapped = spec.wrap(copy.deepcopy(original)).eval()
    g = torch.Generator().manual_seed(0)
    feed_list = [_qwen_feeds(g, 2, 4, 4, 10, pad=3), _qwen_feeds(g, 1, 6, 4, 7)]
    with torch.no_grad():
        for f in feed_list:  # vs diffusers' complex-valued rotary
            rows_cols = [(1, 4, 4)] if f["img_ids"].shape[0] == 16 else [(1, 6, 4)]
            ref = original(**{k: f[k] for k in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep")},
                           img_shapes=[rows_cols] * f["hidden_states"].shape[0], return_dict=False)[0]
            assert torch.allclose(wrapped(**f), ref, atol=1e-5)
        # the text mask: a padded, masked prompt gives what the unpadded prompt gives
        f = feed_list[0]
        short = {**f, "encoder_hidden_states": f["encoder_hidden_states"][:1, :7],
                 "encoder_hidden_states_mask": f["encoder_hidden_states_mask"][:1, :7],
                 "hidden_states": f["hidden_states"][:1], "timestep": f["timestep"][:1], "txt_ids": f["txt_ids"][:7]}
        assert torch.allclose(wrapped(**f)[:1], wrapped(**short), atol=1e-5)
    # ids built by the run-time numpy helper are the ones diffusers' rope table is indexed by
    assert np.array_equal(lat.image_ids(6, 4, centred=True), qwen_image_ids(1, 6, 4, scale_rope=True).numpy())
    info = export_component(spec, wrapped, feed_list, tmp_path / "transformer", OPTS)
    assert info["validation"]["max_rel_error"] < 1e-4


def test_qwen_text_encoder_export_with_padding_mask(qwen, tmp_path):
    spec = decoder_hidden_states_spec("text_encoder", 16, rope_axes=3)
    wrapped = spec.wrap(qwen.text_encoder.model.language_model.eval()).eval()
    g = torch.Generator().manual_seed(2)

    def feeds(batch, seq, pad):
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[-1, seq - pad:] = 0
        return {"input_ids": torch.randint(0, 300, (batch, seq), generator=g), "attention_mask": mask}

    feed_list = [feeds(2, 40, 5), feeds(1, 37, 0)]
    with torch.no_grad():
        for f in feed_list:  # what QwenImagePipeline reads: hidden_states[-1] of the full model
            ref = qwen.text_encoder(**f, output_hidden_states=True).hidden_states[-1]
            keep = f["attention_mask"].bool()
            assert torch.allclose(wrapped(**f)[keep], ref[keep], atol=1e-5)
    info = export_component(spec, wrapped, feed_list, tmp_path / "text_encoder", OPTS)
    assert info["validation"]["max_rel_error"] < 1e-4


def test_qwen_vae_decoder_export_single_frame(qwen, tmp_path):
    vae = copy.deepcopy(qwen.vae).eval()
    assert exact_nearest_upsamples(vae) > 0
    c = vae.config.z_dim
    spec = ComponentSpec(
        "vae_decoder", (TensorSpec("latent_sample", "float32", ("batch_size", c, 1, "height_latent", "width_latent")),),
        (TensorSpec("sample", "float32", ("batch_size", 3, 1, "height", "width")),), _VaeDecoder, atol=2e-3)
    g = torch.Generator().manual_seed(3)
    feed_list = [{"latent_sample": torch.randn(2, c, 1, 8, 8, generator=g)},
                 {"latent_sample": torch.randn(1, c, 1, 6, 10, generator=g)}]
    info = export_component(spec, spec.wrap(vae).eval(), feed_list, tmp_path / "vae_decoder", OPTS)
    assert info["validation"]["max_rel_error"] < 1e-4
