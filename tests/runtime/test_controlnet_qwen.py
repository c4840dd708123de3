"""ControlNet on Qwen-Image (issue 24): `pipe(prompt, controlnets=[...])` reproduces diffusers'
QwenImageControlNetPipeline from the same packed latents, control picture, scale and true CFG (a negative
prompt); the folder's transformer is cut at load (every block's image output takes the net's samples, never
re-exported); the net runs on the conditional batch only, its samples reused for the negative prediction, as
that pipeline does; a Qwen net on a Flux folder and a Flux net on a Qwen folder are refused in one line.

diffusers encodes the control picture with `latent_dist.sample()` (a random draw); the reference here takes
the posterior mean, as our host loop does (the folder's vae_encoder). The folders are built once per test run,
by the helpers the SD3 and Flux files share (controlnet_helpers)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a small red circle on the left"
NEGATIVE = "blurry"
SIZE = 32


@pytest.fixture(scope="module")
def qwen_cn(tiny_qwenimage_diffusers, tiny_qwenimage_enc_onnx, tmp_path_factory):
    """The tiny Qwen-Image folder with its VAE encoder (conftest's, exported at SIZE) and
    controlnet_helpers.FAMILY_NETS["qwenimage"]: "one" a single block (its sample joins after both of the
    transformer's blocks), "two" one per block."""
    from controlnet_helpers import family_controlnet_folder

    out, nets = family_controlnet_folder(tmp_path_factory, "qwenimage", tiny_qwenimage_diffusers,
                                         base=tiny_qwenimage_enc_onnx)
    return Pipeline.from_folder(out), nets


def _latents(seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = SIZE // 4  # VAE factor 4
    x = torch.randn(1, 4, h, h, generator=g)
    return x.view(1, 4, h // 2, 2, h // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, (h // 2) ** 2, 16).numpy()


def _diffusers(src, net_dir, image, latents, steps, guidance, scale, start=0.0, end=1.0, output="np"):
    from controlnet_helpers import diffusers_controlnet_images

    return diffusers_controlnet_images(
        "QwenImageControlNetPipeline", "QwenImageControlNetModel", src, net_dir, image, latents, steps, output,
        prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=guidance, guidance_scale=None, height=SIZE, width=SIZE,
        controlnet_conditioning_scale=scale, control_guidance_start=start, control_guidance_end=end)


@pytest.mark.parametrize("name", ["one", "two"])
def test_qwen_controlnet_matches_diffusers_and_moves_the_image(qwen_cn, tiny_qwenimage_diffusers, name):
    from controlnet_helpers import control_image

    pipe, nets = qwen_cn
    img, lat = control_image(SIZE, 3), _latents(3)
    kw = dict(negative_prompt=NEGATIVE, latents=lat, steps=4, guidance=4.0)
    ours = pipe(PROMPT, controlnets=[(name, img, 0.8)], **kw)
    ref = _diffusers(tiny_qwenimage_diffusers, nets[name], img, lat, 4, 4.0, 0.8)
    plain = pipe(PROMPT, **kw)
    got, moved = psnr(ours.images, ref), psnr(ours.images, plain.images)
    print(f"qwen controlnet {name} vs diffusers: {got:.1f} dB; vs no ControlNet {moved:.1f} dB")
    assert got >= 40.0
    assert moved < 35.0  # the perturbed controlnet blocks matter: parity is not vacuous


def test_qwen_controlnet_start_end_matches_diffusers(qwen_cn, tiny_qwenimage_diffusers):
    from controlnet_helpers import control_image

    pipe, nets = qwen_cn
    img, lat = control_image(SIZE, 5), _latents(5)
    ours = pipe(PROMPT, negative_prompt=NEGATIVE, latents=lat, steps=5, guidance=3.0,
                controlnets=[("two", img, 1.2, 0.2, 0.7)])
    ref = _diffusers(tiny_qwenimage_diffusers, nets["two"], img, lat, 5, 3.0, 1.2, 0.2, 0.7)
    got = psnr(ours.images, ref)
    print(f"qwen controlnet start/end vs diffusers: {got:.1f} dB")
    assert got >= 40.0


def test_qwen_net_sees_the_conditional_batch_only(qwen_cn, tiny_qwenimage_diffusers):
    """The pipeline's negative prediction reuses the samples the net made from the prompt: our latents are
    diffusers' to float noise, and the same run with the net on the whole [uncond; cond] batch is not (the
    image-level 40 dB bar alone would not tell them apart here: 55 dB)."""
    from controlnet_helpers import control_image

    pipe, nets = qwen_cn
    img, lat = control_image(SIZE, 3), _latents(3)
    kw = dict(negative_prompt=NEGATIVE, latents=lat, steps=4, guidance=4.0, controlnets=[("two", img, 0.8)])
    ref = _diffusers(tiny_qwenimage_diffusers, nets["two"], img, lat, 4, 4.0, 0.8, output="latent")
    ours = pipe(PROMPT, **kw).latents
    both_halves = Pipeline.from_folder(pipe.folder)
    both_halves.manifest["controlnets"]["two"]["cond_only"] = False
    other = both_halves(PROMPT, **kw).latents
    err, alt = float(np.abs(ours - ref).max()), float(np.abs(other - ref).max())
    print(f"qwen latents vs diffusers: cond batch {err:.2e}, whole batch {alt:.2e}")
    assert err <= 1e-4 and alt >= 1e-2


def test_qwen_scale_zero_is_no_controlnet(qwen_cn):
    from controlnet_helpers import control_image

    pipe, _ = qwen_cn
    lat = _latents(4)
    kw = dict(negative_prompt=NEGATIVE, latents=lat, steps=3, guidance=4.0)
    plain = pipe(PROMPT, **kw)
    zero = pipe(PROMPT, controlnets=[("one", control_image(SIZE), 0.0)], **kw)
    assert np.array_equal(zero.latents, plain.latents) and np.array_equal(zero.images, plain.images)


@pytest.mark.parametrize("case", ["one_net", "start_end", "no_cfg", "none"])
def test_qwen_loop_and_unrolled_match_the_host_loop(qwen_cn, tmp_path_factory, case):
    from controlnet_helpers import control_image, looped_folder

    pipe, _ = qwen_cn
    looped = Pipeline.from_folder(looped_folder(tmp_path_factory, "qwenimage", pipe.folder, ("two",), 4))
    lat, img = _latents(7), control_image(SIZE, 7)
    kw = {"one_net": dict(controlnets=[("two", img, 0.9)]), "start_end": dict(controlnets=[("two", img, 1.2, 0.3, 0.8)]),
          "no_cfg": dict(controlnets=[("two", img, 0.9)]), "none": {}}[case]
    guidance = 1.0 if case == "no_cfg" else 4.0
    host = looped(PROMPT, negative_prompt=NEGATIVE, latents=lat, steps=4, guidance=guidance, **kw)
    for form in ("loop", "unrolled"):
        got = looped(PROMPT, negative_prompt=NEGATIVE, latents=lat, steps=4, guidance=guidance, loop=form, **kw)
        db = psnr(got.images, host.images)
        print(f"qwen {case} {form} vs host: {db:.1f} dB, max |latents| diff {np.abs(got.latents - host.latents).max():.2e}")
        assert db >= 60.0


def test_qwen_and_flux_controlnets_are_not_swapped(qwen_cn, tiny_flux_diffusers, tiny_flux_onnx, tmp_path):
    from controlnet_helpers import build_tiny_flux_controlnet

    from onnxdiffusion.export.controlnet import add_controlnet

    pipe, nets = qwen_cn
    with pytest.raises(UserError, match="is 'QwenImageControlNetModel'; a flux folder takes a diffusers FluxControlNetModel"):
        add_controlnet(tiny_flux_onnx, nets["one"], "x", out=tmp_path / "a")
    flux_net = build_tiny_flux_controlnet(tiny_flux_diffusers, tmp_path / "flux_net")
    with pytest.raises(UserError, match="is 'FluxControlNetModel'; a qwenimage folder takes a diffusers "
                                        "QwenImageControlNetModel"):
        add_controlnet(pipe.folder, flux_net, "x", out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_qwen_controlnet_configs_refused_in_one_line():
    from onnxdiffusion.families.control_qwen import check_qwen_controlnet

    tr = {"num_attention_heads": 3, "attention_head_dim": 16, "in_channels": 16, "joint_attention_dim": 16,
          "patch_size": 2, "axes_dims_rope": [8, 4, 4], "num_layers": 2}
    net = {**tr, "_class_name": "QwenImageControlNetModel", "num_layers": 1, "extra_condition_channels": 0}
    assert check_qwen_controlnet(net, tr, "qwenimage")["cond_only"]
    for change, match in [({"extra_condition_channels": 4}, "inpainting ControlNet"),
                          ({"num_attention_heads": 2}, "width 32 is not the folder's transformer's 48"),
                          ({"joint_attention_dim": 32}, "joint_attention_dim 32"),
                          ({"num_layers": 0}, "no transformer blocks")]:
        with pytest.raises(UserError, match=match):
            check_qwen_controlnet({**net, **change}, tr, "qwenimage")
