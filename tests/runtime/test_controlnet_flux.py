"""ControlNet on Flux (issue 24): `pipe(prompt, controlnets=[...])` reproduces diffusers' FluxControlNetPipeline
from the same packed latents, control image, scale and guidance; the folder's transformer is cut at load
(double- and single-block image outputs take the net's samples, never re-exported); a Flux ControlNet on an
SD3 folder is refused in one line.

diffusers encodes the control picture with `latent_dist.sample()` (a random draw); the reference here takes
the posterior mean, as our host loop does (the folder's vae_encoder). The folders are built once per test run,
by the helpers the SD3 and Qwen-Image files share (controlnet_helpers)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a small red circle on the left"
SIZE = 32


@pytest.fixture(scope="module")
def flux_cn(tiny_flux_diffusers, tmp_path_factory):
    """The Flux folder with its VAE encoder and controlnet_helpers.FAMILY_NETS["flux"]: "d" one double and one
    single block; "s" single blocks only, two of them for the transformer's one."""
    from controlnet_helpers import family_controlnet_folder

    out, nets = family_controlnet_folder(tmp_path_factory, "flux", tiny_flux_diffusers, size=SIZE)
    return Pipeline.from_folder(out), nets


def _latents(seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = SIZE // 2  # VAE factor 2
    x = torch.randn(1, 4, h, h, generator=g)
    return x.view(1, 4, h // 2, 2, h // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, (h // 2) ** 2, 16).numpy()


def _diffusers(src, net_dir, image, latents, steps, guidance, scale, t5_len):
    from controlnet_helpers import diffusers_controlnet_images

    return diffusers_controlnet_images("FluxControlNetPipeline", "FluxControlNetModel", src, net_dir, image, latents,
                                       steps, prompt=PROMPT, guidance_scale=guidance, height=SIZE, width=SIZE,
                                       controlnet_conditioning_scale=scale, max_sequence_length=t5_len)


@pytest.mark.parametrize("name", ["d", "s"])
def test_flux_controlnet_matches_diffusers_and_moves_the_image(flux_cn, tiny_flux_diffusers, name):
    from controlnet_helpers import control_image

    pipe, nets = flux_cn
    img, lat = control_image(SIZE, 3), _latents(3)
    ours = pipe(PROMPT, latents=lat, steps=4, guidance=3.5, controlnets=[(name, img, 0.8)])
    ref = _diffusers(tiny_flux_diffusers, nets[name], img, lat, 4, 3.5, 0.8,
                     pipe.info["max_lengths"]["text_encoder_2"])
    plain = pipe(PROMPT, latents=lat, steps=4, guidance=3.5)
    got, moved = psnr(ours.images, ref), psnr(ours.images, plain.images)
    print(f"flux controlnet {name} vs diffusers: {got:.1f} dB; vs no ControlNet {moved:.1f} dB")
    assert got >= 40.0
    assert moved < 35.0  # the perturbed controlnet blocks matter: parity is not vacuous


def test_flux_scale_zero_is_no_controlnet(flux_cn):
    from controlnet_helpers import control_image

    pipe, _ = flux_cn
    lat = _latents(4)
    plain = pipe(PROMPT, latents=lat, steps=3, guidance=3.5)
    zero = pipe(PROMPT, latents=lat, steps=3, guidance=3.5, controlnets=[("d", control_image(SIZE), 0.0)])
    assert np.array_equal(zero.latents, plain.latents) and np.array_equal(zero.images, plain.images)


@pytest.mark.parametrize("case", ["one_net", "start_end", "none"])
def test_flux_loop_and_unrolled_match_the_host_loop(flux_cn, tmp_path_factory, case):
    from controlnet_helpers import control_image, looped_folder

    pipe, _ = flux_cn
    looped = Pipeline.from_folder(looped_folder(tmp_path_factory, "flux", pipe.folder, ("d",), 4))
    lat, img = _latents(7), control_image(SIZE, 7)
    kw = {"one_net": dict(controlnets=[("d", img, 0.9)]), "start_end": dict(controlnets=[("d", img, 1.2, 0.3, 0.8)]),
          "none": {}}[case]
    host = looped(PROMPT, latents=lat, steps=4, guidance=3.5, **kw)
    for form in ("loop", "unrolled"):
        got = looped(PROMPT, latents=lat, steps=4, guidance=3.5, loop=form, **kw)
        db = psnr(got.images, host.images)
        print(f"flux {case} {form} vs host: {db:.1f} dB, max |latents| diff {np.abs(got.latents - host.latents).max():.2e}")
        assert db >= 60.0


def test_flux_nets_of_other_residual_shapes_are_refused(flux_cn):
    from controlnet_helpers import control_image

    pipe, _ = flux_cn
    img = control_image(SIZE)
    with pytest.raises(UserError, match="give residuals of different shapes"):
        pipe(PROMPT, steps=2, guidance=3.5, controlnets=[("d", img), ("s", img)])


def test_flux_and_sd3_controlnets_are_not_swapped(flux_cn, tiny_sd3_onnx, tiny_sd3_diffusers, tmp_path):
    from controlnet_helpers import build_tiny_sd3_controlnet

    from onnxdiffusion.export.controlnet import add_controlnet

    pipe, nets = flux_cn
    with pytest.raises(UserError, match="is 'FluxControlNetModel'; a sd3 folder takes a diffusers SD3ControlNetModel"):
        add_controlnet(tiny_sd3_onnx, nets["d"], "x", out=tmp_path / "a")
    sd3_net = build_tiny_sd3_controlnet(tiny_sd3_diffusers, tmp_path / "sd3_net")
    with pytest.raises(UserError, match="is 'SD3ControlNetModel'; a flux folder takes a diffusers FluxControlNetModel"):
        add_controlnet(pipe.folder, sd3_net, "x", out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
