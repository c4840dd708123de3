"""ControlNet on Stable Diffusion 3 (issue 24): `pipe(prompt, controlnets=[...])` reproduces diffusers'
StableDiffusion3ControlNetPipeline from the same latents, control image, scale and guidance; the folder's
transformer is cut at load (block outputs take the net's block samples, never re-exported); a ControlNet of
another family is refused in one line.

diffusers encodes the control picture with `latent_dist.sample()` (a random draw); the reference here takes
the posterior mean, as our host loop does (the folder's vae_encoder). The folders are built once per test run,
by the helpers the Flux and Qwen-Image files share (controlnet_helpers)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a small red circle on the left"


@pytest.fixture(scope="module")
def sd3_cn(tiny_sd3_diffusers, tiny_sd3_onnx, tmp_path_factory):
    """tiny_sd3_onnx with controlnet_helpers.FAMILY_NETS["sd3"]: "z" InstantX-style (zero pooled projections,
    control latents unshifted), "s" shifted, real pooled."""
    from controlnet_helpers import family_controlnet_folder

    return family_controlnet_folder(tmp_path_factory, "sd3", tiny_sd3_diffusers, base=tiny_sd3_onnx)


@pytest.fixture(scope="module")
def sd3_nets(sd3_cn):
    return sd3_cn[1]


@pytest.fixture(scope="module")
def sd3_pipe(sd3_cn):
    return Pipeline.from_folder(sd3_cn[0])


def _latents(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 16, 8, 8), dtype=np.float32)


def _diffusers(src, net_dir, image, latents, steps, guidance, scale):
    from controlnet_helpers import diffusers_controlnet_images

    return diffusers_controlnet_images("StableDiffusion3ControlNetPipeline", "SD3ControlNetModel", src, net_dir, image,
                                       latents, steps, prompt=PROMPT, guidance_scale=guidance, height=image.shape[0],
                                       width=image.shape[1], controlnet_conditioning_scale=scale)


@pytest.mark.parametrize("name", ["z", "s"])
def test_sd3_controlnet_matches_diffusers_and_moves_the_image(sd3_pipe, tiny_sd3_diffusers, sd3_nets, name):
    from controlnet_helpers import control_image

    img, lat = control_image(32, 3), _latents(3)
    ours = sd3_pipe(PROMPT, latents=lat, steps=6, guidance=4.0, controlnets=[(name, img, 0.8)])
    ref = _diffusers(tiny_sd3_diffusers, sd3_nets[name], img, lat, 6, 4.0, 0.8)
    plain = sd3_pipe(PROMPT, latents=lat, steps=6, guidance=4.0)
    got, moved = psnr(ours.images, ref), psnr(ours.images, plain.images)
    print(f"sd3 controlnet {name} vs diffusers: {got:.1f} dB; vs no ControlNet {moved:.1f} dB")
    assert got >= 40.0
    assert moved < 35.0  # the perturbed controlnet_blocks matter: parity is not vacuous


def test_sd3_scale_zero_is_no_controlnet(sd3_pipe):
    from controlnet_helpers import control_image

    lat = _latents(4)
    plain = sd3_pipe(PROMPT, latents=lat, steps=4, guidance=4.0)
    zero = sd3_pipe(PROMPT, latents=lat, steps=4, guidance=4.0, controlnets=[("s", control_image(32), 0.0)])
    assert np.array_equal(zero.latents, plain.latents) and np.array_equal(zero.images, plain.images)


def test_sd3_two_nets_with_start_end_sum(sd3_pipe):
    """Two nets: residuals summed; start/end switch a net off for part of the steps (what ran changes)."""
    from controlnet_helpers import control_image

    lat, imgs = _latents(5), [control_image(32, 5), control_image(32, 6)]
    whole = sd3_pipe(PROMPT, latents=lat, steps=6, guidance=4.0, controlnets=[("z", imgs[0], 0.7), ("s", imgs[1], 1.1)])
    part = sd3_pipe(PROMPT, latents=lat, steps=6, guidance=4.0,
                    controlnets=[("z", imgs[0], 0.7), ("s", imgs[1], 1.1, 0.5, 1.0)])
    one = sd3_pipe(PROMPT, latents=lat, steps=6, guidance=4.0, controlnets=[("z", imgs[0], 0.7)])
    assert not np.array_equal(whole.latents, one.latents) and not np.array_equal(part.latents, whole.latents)


@pytest.mark.parametrize("case", ["two_nets", "one_net", "none"])
def test_sd3_loop_and_unrolled_match_the_host_loop(sd3_pipe, tmp_path_factory, case):
    from controlnet_helpers import control_image, looped_folder

    looped = Pipeline.from_folder(looped_folder(tmp_path_factory, "sd3", sd3_pipe.folder, ("z", "s"), 4))
    lat, imgs = _latents(7), [control_image(32, 7), control_image(32, 8)]
    kw = {"two_nets": dict(controlnets=[("z", imgs[0], 0.7, 0.0, 0.6), ("s", imgs[1], 1.2, 0.3, 1.0)]),
          "one_net": dict(controlnets=[("s", imgs[1], 0.9)]), "none": {}}[case]
    host = looped(PROMPT, latents=lat, steps=4, guidance=4.0, **kw)
    for form in ("loop", "unrolled"):
        got = looped(PROMPT, latents=lat, steps=4, guidance=4.0, loop=form, **kw)
        db = psnr(got.images, host.images)
        print(f"sd3 {case} {form} vs host: {db:.1f} dB, max |latents| diff {np.abs(got.latents - host.latents).max():.2e}")
        assert db >= 60.0


def test_controlnet_of_another_family_is_refused(tiny_sd3_onnx, tiny_onnx, tiny_diffusers, sd3_nets, tmp_path):
    from controlnet_helpers import build_tiny_controlnet

    from onnxdiffusion.export.controlnet import add_controlnet

    with pytest.raises(UserError, match="is 'SD3ControlNetModel'; a sd folder takes a diffusers ControlNetModel"):
        add_controlnet(tiny_onnx, sd3_nets["z"], "x", out=tmp_path / "a")
    unet_net = build_tiny_controlnet(tiny_diffusers, tmp_path / "unet_net")
    with pytest.raises(UserError, match="is 'ControlNetModel'; a sd3 folder takes a diffusers SD3ControlNetModel"):
        add_controlnet(tiny_sd3_onnx, unet_net, "x", out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _node(name, op, inputs, outputs):
    from onnx import helper

    return helper.make_node(op, inputs, outputs, name=name)


@pytest.mark.parametrize("blocks,samples", [(5, 2), (4, 4), (7, 3), (3, 1)])
def test_join_rules_follow_diffusers_intervals(blocks, samples):
    """Which sample joins after which block, on a synthetic graph: SD3 int(i / (blocks / samples)) after every
    block but the last; Flux i // ceil(blocks / samples) after every double and single block."""
    from onnxdiffusion.families.control_flux import flux_joins
    from onnxdiffusion.families.control_sd3 import sd3_joins

    sd3 = [_node(f"/model/transformer_blocks.{i}/Add_3", "Add", [f"h{i}", "x"], [f"h{i + 1}"]) for i in range(blocks)]
    sd3 += [_node(f"/model/transformer_blocks.{i}/norm1/norm/LayerNormalization", "LayerNormalization", [f"h{i}"],
                  [f"n{i}"]) for i in range(1, blocks)]
    got = sd3_joins(sd3, {"backbone_blocks": blocks, "blocks": samples})
    want = [f"controlnet_block_sample_{int(i / (blocks / samples))}" for i in range(blocks - 1)]
    assert [j[0] for j in got] == want and all(j[3] for j in got)
    assert [j[1] for j in got] == [f"/model/transformer_blocks.{i + 1}/norm1/norm/LayerNormalization"
                                   for i in range(blocks - 1)]

    import math

    flux = [_node(f"/model/transformer_blocks.{i}/Add_3", "Add", [f"d{i}", "x"], [f"d{i + 1}"]) for i in range(blocks)]
    flux += [_node(f"/model/transformer_blocks.{i}/norm1/norm/LayerNormalization", "LayerNormalization", [f"d{i}"],
                   [f"m{i}"]) for i in range(1, blocks)]
    flux += [_node(f"/model/single_transformer_blocks.{j}/Concat", "Concat", ["t", f"d{blocks}" if j == 0 else f"s{j}"],
                   [f"c{j}"]) for j in range(2)]
    flux += [_node(f"/model/single_transformer_blocks.{j}/Slice", "Slice", [f"c{j}"], [f"s{j + 1}"]) for j in range(2)]
    flux += [_node("/model/norm_out/norm/LayerNormalization", "LayerNormalization", ["s2"], ["o"])]
    got = flux_joins(flux, {"backbone_blocks": blocks, "backbone_single_blocks": 2, "blocks": samples,
                            "single_blocks": 1})
    step = math.ceil(blocks / samples)
    assert [j[0] for j in got] == ([f"controlnet_block_sample_{i // step}" for i in range(blocks)]
                                   + ["controlnet_single_block_sample_0"] * 2)
    assert [j[1:3] for j in got[blocks - 1:]] == [("/model/single_transformer_blocks.0/Concat", 1),
                                                  ("/model/single_transformer_blocks.1/Concat", 1),
                                                  ("/model/norm_out/norm/LayerNormalization", 0)]
