"""FLUX.2's run-time arithmetic against diffusers' own static helpers (no model built): the empirical mu, the
4-axis latent and reference ids, the batch-norm + un-patchify before decoding, the encoded reference's
normalization and packing; what pipeline_info refuses; and that a FLUX.2 request may come without a picture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxdiffusion.errors import UserError
from onnxdiffusion.families import get_family
from onnxdiffusion.families.flux2 import empirical_mu, image_ids_4d
from onnxdiffusion.folder.manifest import PipelineInfo

KLEIN = get_family("flux2_klein")


def _info(**extra) -> PipelineInfo:
    rng = np.random.default_rng(0)
    return PipelineInfo.from_dict({
        "vae_scaling_factor": 1.0, "vae_scale_factor": 8, "size_multiple": 16, "latent_channels": 4,
        "default_height": 64, "default_width": 64, "model_max_length": 512, "num_train_timesteps": 1000,
        "vae_bn_mean": (rng.standard_normal(16) * 0.3).tolist(), "vae_bn_var": (rng.random(16) * 2 + 0.3).tolist(),
        "vae_batch_norm_eps": 1e-4, **extra})


def _bn(info):
    class BN:
        running_mean = torch.tensor(info.setting("vae_bn_mean"), dtype=torch.float32)
        running_var = torch.tensor(info.setting("vae_bn_var"), dtype=torch.float32)

    return BN


@pytest.mark.parametrize("seq,steps", [(60, 4), (256, 28), (4096, 50), (4301, 4), (8192, 10)])
def test_empirical_mu_is_the_pipelines(seq, steps):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert empirical_mu(seq, steps) == compute_empirical_mu(seq, steps)


def test_latent_and_reference_ids_are_the_pipelines():
    from diffusers import Flux2KleinPipeline

    want = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, 16, 3, 5))[0].numpy()
    np.testing.assert_array_equal(image_ids_4d(3, 5), want)
    info = _info()
    refs = [np.zeros((1, 4, 6, 8), np.float32), np.zeros((1, 4, 4, 2), np.float32)]
    got = KLEIN.reference_inputs(info, refs, batch=2)
    patched = [torch.zeros(1, 16, 3, 4), torch.zeros(1, 16, 2, 1)]  # the pipelines' patchified latents
    want = Flux2KleinPipeline._prepare_image_ids(patched)[0].numpy()
    assert got["reference_latents"].shape == (2, 14, 16)
    np.testing.assert_array_equal(got["reference_ids"][1], want)
    none = KLEIN.reference_inputs(info, [], batch=2)  # text-to-image: no reference token
    assert none["reference_latents"].shape == (2, 0, 16) and none["reference_ids"].shape == (2, 0, 4)


def test_decoder_feed_is_the_pipelines_unpack_batch_norm_unpatchify():
    from diffusers import Flux2KleinPipeline

    info = _info()
    h, w = 48, 80  # 3 x 5 patch tokens of a factor-8 VAE
    tokens = torch.randn(2, 15, 16, generator=torch.Generator().manual_seed(0))
    ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(2, 16, 3, 5))
    x = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids, 3, 5)
    bn = _bn(info)
    x = x * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-4) + bn.running_mean.view(1, -1, 1, 1)
    want = Flux2KleinPipeline._unpatchify_latents(x).numpy()
    # the same arithmetic in the same order; torch's vectorized kernels differ from numpy's by an ulp at most
    np.testing.assert_allclose(KLEIN.decoder_feed(info, tokens.numpy(), h, w), want, rtol=0, atol=1e-6)


def test_diffusers_latents_are_what_the_pipelines_pack_back_to_our_tokens():
    from diffusers import Flux2KleinPipeline

    tokens = np.random.default_rng(2).standard_normal((2, 15, 16)).astype(np.float32)
    patches = KLEIN.diffusers_latents(_info(), tokens, 48, 80)
    np.testing.assert_array_equal(Flux2KleinPipeline._pack_latents(torch.from_numpy(patches)).numpy(), tokens)


def test_reference_latents_are_the_pipelines_normalized_packed_mode():
    from diffusers import Flux2KleinPipeline

    info = _info()
    mode = torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(1))
    patched = Flux2KleinPipeline._patchify_latents(mode)
    bn = _bn(info)
    want = Flux2KleinPipeline._pack_latents(
        (patched - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + 1e-4)).numpy()
    got = KLEIN.reference_inputs(info, [KLEIN.encoder_latents(info, mode.numpy())], batch=1)["reference_latents"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _configs(**tr) -> dict:
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler"},
        "transformer": {"in_channels": 16, "joint_attention_dim": 48, "guidance_embeds": False,
                        "axes_dims_rope": [2, 4, 6, 4], **tr},
        "text_encoder": {"hidden_size": 16, "num_hidden_layers": 28},
        "vae": {"latent_channels": 4, "block_out_channels": [8, 16]},
    }


@pytest.mark.parametrize("tr,match", [({"joint_attention_dim": 32}, "joint_attention_dim"),
                                      ({"guidance_embeds": True}, "guidance_embeds"),
                                      ({"in_channels": 64}, "4x the VAE"),
                                      ({"axes_dims_rope": [4, 6, 6]}, "4 axes")])
def test_mixed_components_are_refused(tr, match):
    assert KLEIN.pipeline_info(_configs())["context_dim"] == 48
    with pytest.raises(UserError, match=match):
        KLEIN.pipeline_info(_configs(**tr))


def test_a_text_encoder_shallower_than_the_layers_read_is_refused():
    configs = _configs()
    configs["text_encoder"]["num_hidden_layers"] = 20
    with pytest.raises(UserError, match="reads hidden states"):
        KLEIN.pipeline_info(configs)


def test_flux2_takes_no_picture_or_several_kontext_needs_one():
    from onnxdiffusion.runtime.references import check_image_request

    for name in ("flux2_klein", "flux2"):
        check_image_request(get_family(name), 0)
        check_image_request(get_family(name), 3)
        with pytest.raises(UserError, match="at most 10"):
            check_image_request(get_family(name), 11)
    with pytest.raises(UserError, match="edits a picture"):
        check_image_request(get_family("flux_kontext"), 0)


@pytest.mark.parametrize("size,match", [((40, 96), "at least 64"), ((64, 600), "aspect ratio")])
def test_reference_sizes_outside_the_pipelines_limits_are_refused(size, match):
    with pytest.raises(UserError, match=match):
        KLEIN.reference_size(_info(), *size)
    assert KLEIN.reference_size(_info(), 2048, 1024) == (1440, 720)  # scaled to 1024^2 px, rounded down to 16
