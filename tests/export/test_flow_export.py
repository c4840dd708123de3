"""Flux and Qwen-Image export wrappers and fix-ups, in torch: each rewrite computes what diffusers'
own module computes. (ONNX vs PyTorch per component, at two shapes, is checked by export itself:
see the manifests in test_flow_families.py.)"""

from __future__ import annotations

import collections
import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxdiffusion.export.fixups import decompose_rms_norms, exact_nearest_upsamples
from onnxdiffusion.export.flow_components import DecoderHiddenStates, FluxTransformer, QwenImageTransformer
from onnxdiffusion.export.rope import qwen_image_ids, rotate_pairs
from onnxdiffusion.families import latents as lat


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


def _batched(ids: np.ndarray, batch: int) -> torch.Tensor:
    return torch.from_numpy(np.repeat(ids[None], batch, axis=0))


@pytest.mark.slow
def test_flux_wrapper_is_diffusers_transformer(flux):
    original = flux.transformer.eval()
    model = copy.deepcopy(original)
    assert decompose_rms_norms(model) > 0  # Flux's q/k norms are torch.nn.RMSNorm
    wrapped = FluxTransformer(model).eval()
    g = torch.Generator().manual_seed(0)
    for batch, rows, cols, text in ((2, 4, 4, 16), (1, 3, 5, 7)):
        x, ctx = torch.randn(batch, rows * cols, 16, generator=g), torch.randn(batch, text, 32, generator=g)
        pooled, t = torch.randn(batch, 32, generator=g), torch.rand(batch, generator=g) * 1000
        guidance = torch.full((batch,), 3.5)
        ids = lat.image_ids(rows, cols)
        with torch.no_grad():
            ref = original(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t / 1000,
                           img_ids=torch.from_numpy(ids), txt_ids=torch.zeros(text, 3), guidance=guidance,
                           return_dict=False)[0]
            got = wrapped(x, t, ctx, pooled, _batched(ids, batch), guidance)
        assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.slow
def test_qwenimage_wrapper_real_rotary_and_text_mask(qwen):
    original = qwen.transformer.eval()
    wrapped = QwenImageTransformer(copy.deepcopy(original)).eval()
    g = torch.Generator().manual_seed(0)
    for batch, rows, cols, text, pad in ((2, 4, 4, 10, 3), (1, 3, 2, 7, 0)):
        x, ctx = torch.randn(batch, rows * cols, 16, generator=g), torch.randn(batch, text, 16, generator=g)
        mask = torch.ones(batch, text)
        mask[0, text - pad:] = 0
        t = torch.rand(batch, generator=g) * 1000
        ids = _batched(lat.image_ids(rows, cols, centred=True), batch)
        with torch.no_grad():  # vs diffusers' complex-valued rotary and its own text positions
            ref = original(hidden_states=x, encoder_hidden_states=ctx, encoder_hidden_states_mask=mask, timestep=t / 1000,
                           img_shapes=[[(1, rows, cols)]] * batch, return_dict=False)[0]
            got = wrapped(x, t, ctx, mask, ids)
            assert torch.allclose(got, ref, atol=1e-5)
            if pad:  # the text mask: a padded, masked prompt gives what the unpadded prompt gives
                short = wrapped(x[:1], t[:1], ctx[:1, :text - pad], mask[:1, :text - pad], ids[:1])
                assert torch.allclose(got[:1], short, atol=1e-5)
    # the run-time numpy ids are the ones diffusers' rope table is indexed by
    assert np.array_equal(lat.image_ids(6, 4, centred=True), qwen_image_ids(1, 6, 4, scale_rope=True).numpy())


@pytest.mark.slow
def test_qwen_text_encoder_wrapper_reads_hidden_states_under_the_mask(qwen):
    wrapped = DecoderHiddenStates(qwen.text_encoder.model.language_model.eval(), rope_axes=3).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.int64)
    mask[1, 14:] = 0
    with torch.no_grad():  # what QwenImagePipeline reads: hidden_states[-1] of the full model
        ref = qwen.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        got = wrapped(ids, mask)
    keep = mask.bool()
    assert torch.allclose(got[keep], ref[keep], atol=1e-5)
