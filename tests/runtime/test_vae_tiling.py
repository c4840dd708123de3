"""Tiled VAE decoding (runtime/vae_tiling.py, `memory vae_tile=N`): exact when one tile covers the image,
close when tiled (the embedded model's trained decoder), a seamless blend, one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.memory import memory_options
from onnxdiffusion.runtime.vae_tiling import _ramps, tile_starts, tiled_decode

SETTINGS = dict(steps=6, guidance=4.0)
# measured on the embedded model's trained decoder (64x64 native, mid-block attention over the whole
# latent), 128x128 images of 3 prompts vs untiled: 32-pixel tiles with 8 overlap 25.8 / 27.8 / 29.7 dB
# (butted tiles, overlap 0: 23.0 / 22.0 / 27.3), 64-pixel tiles with 16 overlap 30.0 / 35.2 / 39.4 dB
TILED_MIN_DB = {(32, 8): 24.0, (64, 16): 28.0}


@pytest.fixture(scope="module")
def pipes():
    return {spec: Pipeline.from_folder(None, threads=1, memory=spec)
            for spec in ("default", "vae_tile=64", "vae_tile=32,vae_overlap=8", "vae_tile=64,vae_overlap=16")}


def test_one_tile_covering_the_image_is_the_untiled_decode(pipes):
    a = pipes["default"]("a red circle on the left", seed=3, **SETTINGS)
    b = pipes["vae_tile=64"]("a red circle on the left", seed=3, **SETTINGS)  # 64x64: one tile
    assert np.array_equal(a.images, b.images)


@pytest.mark.parametrize("tile,overlap", sorted(TILED_MIN_DB))
def test_tiled_decode_close_to_untiled(pipes, tile, overlap):
    ref, tiled = pipes["default"], pipes[f"vae_tile={tile},vae_overlap={overlap}"]
    for seed, prompt in enumerate(("a red circle on the left", "a blue star above a yellow square", "a green ring")):
        x = ref(prompt, seed=seed, height=128, width=128, **SETTINGS).latents
        full = ref.decode(x, 128, 128)
        got = tiled.decode(x, 128, 128)
        assert got.shape == full.shape == (1, 128, 128, 3)
        db = psnr(full, got)
        assert db >= TILED_MIN_DB[(tile, overlap)], f"{prompt}: {db:.2f} dB"
        if (tile, overlap) == (32, 8):  # the cross-fade does better than butting tiles together
            run = lambda z: ref.vae_decoder.run(["sample"], {"latent_sample": z})[0]  # noqa: E731
            feed = ref.family.decoder_feed(ref.info, x, 128, 128)
            butted = np.clip(tiled_decode(run, feed, 32, 0, 4) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)
            assert db > psnr(full, (butted * 255).round().astype(np.uint8))


def test_blend_is_exact_for_a_pointwise_decoder():
    """A decoder without spatial context (nearest upsampling x4 of a per-pixel map): tiled == untiled,
    so the weights of the tiles over every pixel sum to one and every pixel is covered."""
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, 37, 53)).astype(np.float32)
    run = lambda x: np.repeat(np.repeat(np.tanh(x[:, :3] * 2), 4, axis=-2), 4, axis=-1)  # noqa: E731
    full = run(latents)
    for tile, overlap in ((32, 8), (64, 16), (48, 20), (200, 0), (16, 4)):
        got = tiled_decode(run, latents, tile, overlap, 4)
        np.testing.assert_allclose(got, full, rtol=0, atol=2e-6)


def test_tile_layout():
    assert tile_starts(32, 64, 8) == [0]
    assert tile_starts(64, 32, 8) == [0, 16, 32]  # 3 tiles, overlaps of 16 >= 8, evenly spread
    for size, tile, overlap in ((64, 32, 8), (37, 8, 2), (100, 30, 7), (33, 32, 0)):
        starts = tile_starts(size, tile, overlap)
        assert starts[0] == 0 and starts[-1] + tile == size
        assert all(b - a <= tile - overlap for a, b in zip(starts, starts[1:]))
        for w in _ramps(starts, tile, 4):
            assert w.shape == (tile * 4,) and (w > 0).all() and (w <= 1).all()


@pytest.mark.parametrize("spec,message", [
    ("vae_tile=abc", "bad memory setting"),
    ("vae_tile=-32", "bad memory setting"),
    ("vae_tile=64,vae_overlap=32", "less than half"),
    ("release_text_encoders=7", "bad memory setting"),
])
def test_bad_tile_settings_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        memory_options(spec)
    assert "\n" not in str(e.value)


def test_tile_not_a_multiple_of_the_scale_factor_fails_before_loading():
    with pytest.raises(UserError, match="multiples of the VAE's scale factor 4") as e:
        Pipeline.from_folder(None, memory="vae_tile=30,vae_overlap=8")
    assert "\n" not in str(e.value)
    m = memory_options("lean,vae_tile=256")
    assert m.vae_tile == 256 and m.vae_tile_overlap == 64 and m.release_text_encoders
