"""ControlNet on the UNet families (issue 24): `pipe(prompt, controlnets=[...])` reproduces diffusers'
StableDiffusion(XL)ControlNetPipeline and MultiControlNetModel from the same latents, control image, scale,
start/end and guidance; the folder's UNet is cut at load (never re-exported), also when int8-static
quantized; bad input is one line and writes nothing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.techniques.controlnet import ControlNetSpec

PROMPT = "a small red circle on the left"


@pytest.fixture(scope="module")
def nets(tiny_diffusers, tmp_path_factory):
    from controlnet_helpers import build_tiny_controlnet

    root = tmp_path_factory.mktemp("cn")
    return {"a": build_tiny_controlnet(tiny_diffusers, root / "a", seed=0),
            "b": build_tiny_controlnet(tiny_diffusers, root / "b", seed=1, std=0.2)}


@pytest.fixture(scope="module")
def sd_folder(tiny_onnx, nets, tmp_path_factory):
    from onnxdiffusion.export.controlnet import add_controlnet

    out = tmp_path_factory.mktemp("sd_cn") / "model"
    add_controlnet(tiny_onnx, nets["a"], "a", out=out)
    add_controlnet(out, nets["b"], "b")
    return out


@pytest.fixture(scope="module")
def sd_pipe(sd_folder):
    return Pipeline.from_folder(sd_folder)


def _latents(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _diffusers(pipeline_cls, src, controlnet, prompt, image, latents, steps, guidance, scheduler=None, **kw):
    """diffusers' ControlNet pipeline from our latents and control image(s), as uint8."""
    import diffusers
    import torch
    from PIL import Image

    pipe = pipeline_cls.from_pretrained(src, controlnet=controlnet, local_files_only=True,
                                        **({"safety_checker": None, "requires_safety_checker": False}
                                           if "XL" not in pipeline_cls.__name__ else {}))
    if scheduler is not None:
        cls_name, options = scheduler
        pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **options)
    pipe.set_progress_bar_config(disable=True)
    images = [Image.fromarray(i) for i in image] if isinstance(image, list) else Image.fromarray(image)
    h = w = (image[0] if isinstance(image, list) else image).shape[0]
    out = pipe(prompt, image=images, latents=torch.from_numpy(latents), num_inference_steps=steps,
               guidance_scale=guidance, output_type="np", height=h, width=w, **kw).images
    return (out * 255).round().astype(np.uint8)


def _net(path):
    from diffusers import ControlNetModel

    return ControlNetModel.from_pretrained(path, local_files_only=True)


def test_sd_controlnet_matches_diffusers_and_moves_the_image(sd_pipe, tiny_diffusers, nets):
    from controlnet_helpers import control_image
    from diffusers import StableDiffusionControlNetPipeline

    img, lat = control_image(32), _latents((1, 4, 8, 8))
    ours = sd_pipe(PROMPT, latents=lat, steps=8, guidance=4.0, sampler="euler", controlnets=[("a", img, 0.8)])
    ref = _diffusers(StableDiffusionControlNetPipeline, tiny_diffusers, _net(nets["a"]), PROMPT, img, lat, 8, 4.0,
                     scheduler=("EulerDiscreteScheduler", {}), controlnet_conditioning_scale=0.8)
    plain = sd_pipe(PROMPT, latents=lat, steps=8, guidance=4.0, sampler="euler")
    got, moved = psnr(ours.images, ref), psnr(ours.images, plain.images)
    print(f"sd controlnet vs diffusers: {got:.1f} dB; vs no ControlNet {moved:.1f} dB")
    assert got >= 40.0
    assert moved < 35.0  # the perturbed zero convolutions matter: parity is not vacuous


def test_scale_zero_is_no_controlnet(sd_pipe):
    from controlnet_helpers import control_image

    lat = _latents((1, 4, 8, 8), 3)
    plain = sd_pipe(PROMPT, latents=lat, steps=5, guidance=4.0)
    zero = sd_pipe(PROMPT, latents=lat, steps=5, guidance=4.0, controlnets=[ControlNetSpec("a", control_image(32), 0.0)])
    assert np.array_equal(zero.latents, plain.latents) and np.array_equal(zero.images, plain.images)


def test_two_nets_with_start_end_match_multicontrolnet(sd_pipe, tiny_diffusers, nets):
    from controlnet_helpers import control_image
    from diffusers import StableDiffusionControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    imgs, lat = [control_image(32, 1), control_image(32, 2)], _latents((1, 4, 8, 8), 1)
    ours = sd_pipe(PROMPT, latents=lat, steps=10, guidance=5.0, sampler="dpmpp_2m",
                   controlnets=[("a", imgs[0], 0.7, 0.0, 0.45), ("b", imgs[1], 1.3, 0.3, 1.0)])
    multi = MultiControlNetModel([_net(nets["a"]), _net(nets["b"])])
    ref = _diffusers(StableDiffusionControlNetPipeline, tiny_diffusers, multi, PROMPT, imgs, lat, 10, 5.0,
                     scheduler=("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
                     controlnet_conditioning_scale=[0.7, 1.3], control_guidance_start=[0.0, 0.3],
                     control_guidance_end=[0.45, 1.0])
    got = psnr(ours.images, ref)
    whole = sd_pipe(PROMPT, latents=lat, steps=10, guidance=5.0, sampler="dpmpp_2m",
                    controlnets=[("a", imgs[0], 0.7), ("b", imgs[1], 1.3)])
    print(f"two nets, start/end, vs MultiControlNetModel: {got:.1f} dB; vs whole range {psnr(ours.images, whole.images):.1f} dB")
    assert got >= 40.0
    assert not np.array_equal(ours.images, whole.images)  # start/end changed what ran


@pytest.mark.slow
def test_sdxl_controlnet_matches_diffusers(tiny_sdxl_diffusers, tiny_sdxl_onnx, tmp_path):
    from controlnet_helpers import build_tiny_controlnet, control_image
    from diffusers import StableDiffusionXLControlNetPipeline

    from onnxdiffusion.export.controlnet import add_controlnet

    net = build_tiny_controlnet(tiny_sdxl_diffusers, tmp_path / "cn_xl", seed=4)
    add_controlnet(tiny_sdxl_onnx, net, "xl", out=tmp_path / "model")
    pipe = Pipeline.from_folder(tmp_path / "model")
    img, lat = control_image(32, 5), _latents((1, 4, 8, 8), 5)
    ours = pipe(PROMPT, latents=lat, steps=8, guidance=5.0, controlnets=[("xl", img, 0.9)])
    ref = _diffusers(StableDiffusionXLControlNetPipeline, tiny_sdxl_diffusers, _net(net), PROMPT, img, lat, 8, 5.0,
                     controlnet_conditioning_scale=0.9)
    plain = pipe(PROMPT, latents=lat, steps=8, guidance=5.0)
    got, moved = psnr(ours.images, ref), psnr(ours.images, plain.images)
    print(f"sdxl controlnet vs diffusers: {got:.1f} dB; vs no ControlNet {moved:.1f} dB")
    assert got >= 40.0 and moved < 35.0


def test_composes_with_img2img_and_inpainting(sd_pipe):
    from controlnet_helpers import control_image

    img, lat = control_image(32, 6), _latents((1, 4, 8, 8), 6)
    picture = control_image(32, 7)
    mask = np.zeros((32, 32), np.uint8)
    mask[:, 16:] = 255
    for kw in ({"image": picture, "strength": 0.6}, {"image": picture, "mask": mask, "strength": 0.9}):
        plain = sd_pipe(PROMPT, latents=lat, steps=8, guidance=4.0, **kw)
        ours = sd_pipe(PROMPT, latents=lat, steps=8, guidance=4.0, controlnets=[("a", img)], **kw)
        assert ours.settings["controlnets"][0]["name"] == "a"
        assert not np.array_equal(ours.images, plain.images)


@pytest.fixture(scope="module")
def looped(sd_folder, tmp_path_factory):
    """The folder with both nets built into a Loop graph and a 6-step unrolled graph."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    out = tmp_path_factory.mktemp("cn_loop") / "model"
    compile_loop(sd_folder, out, controlnets=("a", "b"))
    compile_loop(out, out, form="unrolled", steps=6, controlnets=("a", "b"))
    return Pipeline.from_folder(out)


@pytest.mark.parametrize("case", ["two_nets", "one_net_img2img", "none"])
def test_loop_and_unrolled_match_the_host_loop(looped, case):
    from controlnet_helpers import control_image

    lat = _latents((1, 4, 8, 8), 11)
    imgs = [control_image(32, 12), control_image(32, 13)]
    kw = {"two_nets": dict(controlnets=[("a", imgs[0], 0.7, 0.0, 0.6), ("b", imgs[1], 1.2, 0.3, 1.0)]),
          "one_net_img2img": dict(controlnets=[("b", imgs[1], 0.9)], image=control_image(32, 14), strength=0.7),
          "none": {}}[case]
    host = looped(PROMPT, latents=lat, steps=6, guidance=4.0, sampler="dpmpp_2m", **kw)
    for form in ("loop",) if "image" in kw else ("loop", "unrolled"):  # (unrolled: a fixed count of evaluations)
        got = looped(PROMPT, latents=lat, steps=6, guidance=4.0, sampler="dpmpp_2m", loop=form, **kw)
        db = psnr(got.images, host.images)
        print(f"{case} {form} vs host: {db:.1f} dB, max |latents| diff {np.abs(got.latents - host.latents).max():.2e}")
        assert db >= 60.0


def test_loop_graph_without_the_net_is_refused(sd_folder, tmp_path):
    from controlnet_helpers import control_image

    from onnxdiffusion.loopgraph.compile import compile_loop

    compile_loop(sd_folder, tmp_path / "m", controlnets=("a",))
    pipe = Pipeline.from_folder(tmp_path / "m")
    with pytest.raises(UserError, match="not built into this folder's loop graph"):
        pipe(PROMPT, steps=2, loop="loop", controlnets=[("b", control_image(32))])
    with pytest.raises(UserError, match="no ControlNet 'zz'"):
        compile_loop(sd_folder, tmp_path / "n", controlnets=("zz",))
    assert not (tmp_path / "n").exists()
