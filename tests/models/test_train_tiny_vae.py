"""models/training/train_tiny_vae.py's fine-tune on the models' own latents: the data it makes, the edge
weighting, and a resumable fine-tune that trains the decoder only."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
import train_tiny_vae as T

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "shapes-sd-onnx"
TINY = ROOT / "models" / "shapes-sd" / "vae_tiny"


def test_edge_weights_mark_edges_only():
    img = -torch.ones(1, 3, 16, 16)
    img[..., 4:12, 4:12] = 1.0  # a square
    w = T.edge_weights(img, 4.0)
    assert w.shape == (1, 1, 16, 16)
    assert float(w[0, 0, 4, 4]) == pytest.approx(5.0) and float(w[0, 0, 3, 8]) == pytest.approx(5.0)
    assert float(w[0, 0, 0, 0]) == 1.0 and float(w[0, 0, 8, 8]) == 1.0  # flat background and inside
    assert torch.equal(T.edge_weights(img, 0.0), torch.ones(1, 1, 16, 16))


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    out = tmp_path_factory.mktemp("latents")
    T.make_latents(SHIPPED, out, count=2, batch=2, scene_start=0)
    return out


def test_made_latents_are_the_tiny_decoders_feed(latents):
    """Raw latents (the tiny decoder's feed) and the VAE's images of them: the shipped tiny decoder maps one to
    close to the other, which a wrongly scaled feed would not."""
    from diffusers import AutoencoderTiny

    data = np.load(latents / SHIPPED.name / "chunk_000.npz")
    assert data["latents"].shape == (2, 4, 16, 16) and data["latents"].dtype == np.float32
    assert data["target"].shape == (2, 3, 64, 64) and data["target"].dtype == np.uint8
    tiny = AutoencoderTiny.from_pretrained(TINY).float().eval()
    with torch.no_grad():
        out = tiny.decoder(torch.from_numpy(data["latents"])).clamp(-1, 1)
    mse = float(((out - T.to_image(data["target"])) ** 2).mean())
    assert 10 * np.log10(4 / mse) > 24
    wrong = torch.from_numpy(data["latents"]) * 1.0496  # the scaled latents, not the raw ones
    with torch.no_grad():
        bad = float(((tiny.decoder(wrong).clamp(-1, 1) - T.to_image(data["target"])) ** 2).mean())
    assert bad > mse


def _args(work, latents, steps):
    return argparse.Namespace(work=str(work), steps=steps, batch=4, lr=1e-3, seed=0, threads=1, checkpoint_every=2,
                              encoder_every=4, out=None, ema=0.9, finetune_latents=str(latents), init=str(TINY),
                              posterior_share=0.25, posterior_chunks=1, edge_weight=2.0, patch_weight=0.0, patch=8,
                              hard_share=0.0, hard_top=0.1)


def test_finetune_trains_the_decoder_only_and_resumes(latents, tmp_path, monkeypatch):
    from diffusers import AutoencoderTiny
    from safetensors.torch import load_file

    monkeypatch.setattr(T, "CHUNK", 4)  # small posterior chunks: the test makes one
    T.train(_args(tmp_path, latents, 2))
    assert T.torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 2
    T.train(_args(tmp_path, latents, 3))  # resumes at step 2
    state = T.torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 3
    start = AutoencoderTiny.from_pretrained(TINY).float().state_dict()
    model = state["model"]
    assert all(torch.equal(model[k], start[k]) for k in start if k.startswith("encoder."))
    assert any(not torch.equal(model[k], start[k]) for k in start if k.startswith("decoder."))
    saved = load_file(tmp_path / "vae_tiny" / "diffusion_pytorch_model.safetensors")
    assert all(v.dtype == torch.float16 for v in saved.values())


def test_finetune_without_latents_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no latent chunks"):
        T.load_latents(tmp_path)
