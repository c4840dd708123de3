"""Run-time (numpy, tokenizers) pieces of Flux and Qwen-Image against diffusers' torch versions."""

from __future__ import annotations

import pytest

import numpy as np
import torch

from onnxdiffusion.families import latents as lat
from onnxdiffusion.runtime.tokenizer import PaddedTokenizer, PromptTokenizer


def test_pack_unpack_match_diffusers():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 10)
    packed = FluxPipeline._pack_latents(x, 2, 4, 6, 10)
    np.testing.assert_array_equal(lat.pack_patches(x.numpy()), packed.numpy())
    # diffusers' unpack takes the image size; vae factor 2 -> latent 6x10 from a 12x20 image
    np.testing.assert_array_equal(lat.unpack_patches(packed.numpy(), 6, 10),
                                  FluxPipeline._unpack_latents(packed, 12, 20, 2).numpy())


def test_flux_image_ids_match_diffusers():
    from diffusers import FluxPipeline

    want = FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(lat.image_ids(3, 5), want)


@pytest.mark.slow
def test_t5_tokenizer_pads_and_truncates_like_transformers(tiny_flux_diffusers):
    from transformers import T5TokenizerFast

    ref = T5TokenizerFast.from_pretrained(tiny_flux_diffusers / "tokenizer_2")
    tok = PromptTokenizer(tiny_flux_diffusers / "tokenizer_2", 16)  # what Flux's T5 slot runs
    prompts = ["a red circle", "a small blue square on the left of a large yellow star above a green ring and more words"]
    ids = tok(prompts)
    want = ref(prompts, padding="max_length", max_length=16, truncation=True).input_ids
    assert ids.shape == (2, 16) and ids.tolist() == want


@pytest.mark.slow
def test_qwen_tokenizer_template_and_mask_like_transformers(tiny_qwenimage_diffusers):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_qwenimage_diffusers)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    tok = PaddedTokenizer(tiny_qwenimage_diffusers / "tokenizer", max_length=None, template=template)
    prompts = ["a red circle", " "]
    limit = pipe.tokenizer_max_length + drop
    ids, mask = tok(prompts, pad_to_max=False, truncate_to=limit)
    want = pipe.tokenizer([template.format(p) for p in prompts], max_length=limit, padding=True, truncation=True)
    assert ids.tolist() == want.input_ids and mask.tolist() == want.attention_mask
    assert mask[1].sum() < mask[0].sum()  # the shorter prompt is padded and masked
