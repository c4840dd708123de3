"""ControlNet on Z-Image (issue 42): `pipe(prompt, controlnets=[...])` reproduces diffusers'
ZImageControlNetPipeline from the same latents, control picture, scale and guidance (a negative prompt, a
non-square size that needs the transformer's image pad tokens), in the host loop and in the Loop and unrolled
graphs; the folder's transformer is cut at load (after each control place the unified sequence takes the net's
hint); ZImageControlNetInpaintPipeline's context too; scale 0 is no ControlNet; int8-static runs with one; bad
requests are refused in one line, nothing written.

The net borrows the transformer's embedders and refiners (`from_transformer`), so `add_controlnet` reads the
diffusers folder the model came from (`backbone=`). diffusers encodes the control picture with the VAE's mode,
as our host loop does (the folder's vae_encoder). The folders are built once per test run
(controlnet_helpers.FAMILY_NETS["zimage"])."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a small red circle on the left"
NEGATIVE = "a blurry dark picture of nothing at all"
H, W = 40, 56  # 10 x 14 latents: 35 patch tokens, padded to 64 by the transformer's pad token


@pytest.fixture(scope="module")
def zimage_cn(tiny_zimage_diffusers, tmp_path_factory):
    """The tiny Z-Image folder with its VAE encoder and two nets: "all" hints after both main layers; "ref" one
    after layer 0, 9 control channels (a 2.0 net: the inpainting context, or the latents zero-padded) and a
    control noise refiner."""
    from controlnet_helpers import family_controlnet_folder

    names = ("text_encoder", "transformer", "vae_decoder", "vae_encoder")
    out, nets = family_controlnet_folder(tmp_path_factory, "zimage", tiny_zimage_diffusers, components=names)
    return Pipeline.from_folder(out), nets


def _looped(tmp_path_factory, folder, name: str):
    """`folder` with net `name` in a Loop graph and a 4-step unrolled graph (nets of other places cannot share one)."""
    from controlnet_helpers import looped_folder

    return Pipeline.from_folder(looped_folder(tmp_path_factory, f"zimage_{name}", folder, (name,), 4))


def _latents(seed: int) -> np.ndarray:
    import torch

    return torch.randn(1, 4, H // 4, W // 4, generator=torch.Generator().manual_seed(seed)).numpy()


def _picture(seed: int) -> np.ndarray:
    from controlnet_helpers import control_image
    from PIL import Image

    return np.asarray(Image.fromarray(control_image(H, seed)).resize((W, H)))  # the generation size: no resize notice


def _diffusers(src, net_dir, image, latents, guidance, scale, negative=None, output="np"):
    from controlnet_helpers import diffusers_controlnet_images

    kw = {} if negative is None else {"negative_prompt": negative}
    return diffusers_controlnet_images("ZImageControlNetPipeline", "ZImageControlNetModel", src, net_dir, image, latents,
                                       4, output, prompt=PROMPT, guidance_scale=guidance, height=H, width=W,
                                       controlnet_conditioning_scale=scale, **kw)


@pytest.mark.parametrize("name,guidance,negative", [("all", 3.0, NEGATIVE), ("ref", 3.0, None), ("ref", 0.0, None)])
def test_zimage_controlnet_matches_diffusers_host_and_loop(zimage_cn, tiny_zimage_diffusers, tmp_path_factory, name,
                                                           guidance, negative):
    pipe, nets = zimage_cn
    img, lat = _picture(3), _latents(3)
    kw = dict(negative_prompt=negative, latents=lat, steps=4, guidance=guidance, height=H, width=W)
    ref = _diffusers(tiny_zimage_diffusers, nets[name], img, lat, guidance, 0.8, negative)
    ours = pipe(PROMPT, controlnets=[(name, img, 0.8)], **kw)
    plain = pipe(PROMPT, **kw)
    looped = _looped(tmp_path_factory, pipe.folder, name)
    got = {"host": psnr(ours.images, ref)}
    for form in ("loop", "unrolled"):
        got[form] = psnr(looped(PROMPT, controlnets=[(name, img, 0.8)], loop=form, **kw).images, ref)
    moved = psnr(ours.images, plain.images)
    print(f"zimage controlnet {name} g={guidance} vs diffusers: "
          + ", ".join(f"{k} {v:.1f} dB" for k, v in got.items()) + f"; vs no ControlNet {moved:.1f} dB")
    assert min(got.values()) >= 40.0
    assert moved < 35.0  # the perturbed projections matter: parity is not vacuous


def _inpaint_diffusers(src, net_dir, control, picture, mask, latents, guidance, scale):
    import diffusers
    import torch
    from PIL import Image

    net = diffusers.ZImageControlNetModel.from_pretrained(net_dir, local_files_only=True)
    pipe = diffusers.ZImageControlNetInpaintPipeline.from_pretrained(src, controlnet=net, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=PROMPT, image=Image.fromarray(picture), mask_image=Image.fromarray(mask),
               control_image=Image.fromarray(control), latents=torch.from_numpy(latents), num_inference_steps=4,
               guidance_scale=guidance, height=H, width=W, controlnet_conditioning_scale=scale, output_type="np").images
    return (out * 255).round().astype(np.uint8)


def test_zimage_inpaint_context_matches_diffusers_host_and_loop(zimage_cn, tiny_zimage_diffusers, tmp_path_factory):
    """ZImageControlNetInpaintPipeline: the net's context is the control latents, the keep mask and the latents of
    the picture with the masked part blanked (`ControlNetSpec(inpaint=(picture, mask))`); the sampling is the
    text-to-image one (no blend)."""
    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    pipe, nets = zimage_cn
    control, picture, lat = _picture(3), _picture(8), _latents(3)
    mask = np.zeros((H, W), np.uint8)
    mask[8:30, 20:50] = 255
    kw = dict(latents=lat, steps=4, guidance=3.0, height=H, width=W)
    spec = ControlNetSpec("ref", control, 0.8, inpaint=(picture, mask))
    ref = _inpaint_diffusers(tiny_zimage_diffusers, nets["ref"], control, picture, mask, lat, 3.0, 0.8)
    ours = pipe(PROMPT, controlnets=[spec], **kw)
    looped = _looped(tmp_path_factory, pipe.folder, "ref")
    got = {"host": psnr(ours.images, ref), "loop": psnr(looped(PROMPT, controlnets=[spec], loop="loop", **kw).images, ref)}
    moved = psnr(ours.images, pipe(PROMPT, controlnets=[("ref", control, 0.8)], **kw).images)
    print(f"zimage inpaint controlnet vs diffusers: host {got['host']:.1f} dB, loop {got['loop']:.1f} dB; "
          f"vs the plain context {moved:.1f} dB")
    assert min(got.values()) >= 40.0 and moved < 35.0
    with pytest.raises(UserError, match="this ZImageControlNetModel takes no inpainting context"):
        pipe(PROMPT, controlnets=[ControlNetSpec("all", control, 0.8, inpaint=(picture, mask))], **kw)
    with pytest.raises(UserError, match="inpaint must be \\(picture, mask\\)"):
        pipe(PROMPT, controlnets=[ControlNetSpec("ref", control, 0.8, inpaint=picture)], **kw)


def test_control_inpaint_flag_gives_the_python_image(zimage_cn, tmp_path):
    """`generate --control-inpaint PICTURE,MASK` is `ControlNetSpec(..., inpaint=(picture, mask))`: the same image,
    and the Python API's refusals in one line, nothing written."""
    from cli_helpers import assert_one_line_error, run_cli_here
    from PIL import Image

    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    pipe, _ = zimage_cn
    control, picture = _picture(3), _picture(8)
    mask = np.zeros((H, W), np.uint8)
    mask[8:30, 20:50] = 255
    files = {}
    for name, array in (("control", control), ("picture", picture), ("mask", mask)):
        files[name] = tmp_path / f"{name}.png"
        Image.fromarray(array).save(files[name])
    context = f"{files['picture']},{files['mask']}"
    common = ["--control", files["control"], "--steps", "3", "--guidance", "3", "--height", H, "--width", W,
              "--seed", "5"]
    out = tmp_path / "cli.png"
    proc = run_cli_here("generate", pipe.folder, PROMPT, "--controlnet", "ref:0.8", "--control-inpaint", context,
                        *common, "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kw = dict(steps=3, guidance=3.0, height=H, width=W, seed=5)
    want = pipe(PROMPT, controlnets=[ControlNetSpec("ref", control, 0.8, inpaint=(picture, mask))], **kw).images[0]
    got = np.asarray(Image.open(out).convert("RGB"))
    assert np.array_equal(got, want)
    assert psnr(got, pipe(PROMPT, controlnets=[("ref", control, 0.8)], **kw).images[0]) < 35.0  # the context matters
    bad = tmp_path / "bad.png"
    for net, value, fragment in [("all:0.8", context, "this ZImageControlNetModel takes no inpainting context"),
                                 ("ref:0.8", str(files["picture"]), "ControlNet 'ref': inpaint must be (picture, mask)")]:
        proc = run_cli_here("generate", pipe.folder, PROMPT, "--controlnet", net, "--control-inpaint", value, *common,
                            "-o", bad)
        assert_one_line_error(proc, fragment)
        assert not bad.exists()


def test_zimage_start_end_loop_matches_host(zimage_cn, tmp_path_factory):
    """ZImageControlNetPipeline has no control_guidance_start/end: ours (diffusers' meaning in its other
    ControlNet pipelines) gives the same picture in the host loop and the graphs."""
    pipe, _ = zimage_cn
    looped = _looped(tmp_path_factory, pipe.folder, "all")
    kw = dict(negative_prompt=NEGATIVE, latents=_latents(5), steps=4, guidance=3.0, height=H, width=W,
              controlnets=[("all", _picture(5), 1.2, 0.25, 0.75)])
    host = looped(PROMPT, **kw)
    full = looped(PROMPT, **{**kw, "controlnets": [("all", _picture(5), 1.2)]})
    assert psnr(host.images, full.images) < 60  # the steps left out changed the picture
    for form in ("loop", "unrolled"):
        assert psnr(looped(PROMPT, loop=form, **kw).images, host.images) >= 60


def test_zimage_scale_zero_is_no_controlnet(zimage_cn, tmp_path_factory):
    pipe, _ = zimage_cn
    kw = dict(latents=_latents(4), steps=3, guidance=3.0, height=H, width=W)
    plain = pipe(PROMPT, **kw)
    zero = pipe(PROMPT, controlnets=[("ref", _picture(4), 0.0)], **kw)
    assert np.array_equal(zero.latents, plain.latents) and np.array_equal(zero.images, plain.images)
    looped = _looped(tmp_path_factory, pipe.folder, "ref")
    kw["steps"] = 4
    graph = looped(PROMPT, loop="loop", controlnets=[("ref", _picture(4), 0.0)], **kw)
    assert psnr(graph.images, looped(PROMPT, **kw).images) >= 60


def test_zimage_int8_static_runs_with_a_controlnet(zimage_cn, tmp_path):
    """The quantized transformer is cut the same way (its control places' float edges, before their Q/DQ)."""
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.quantize.configs import recipe_class

    pipe, _ = zimage_cn
    out = tmp_path / "int8"
    cal = CalibrationConfig(count=4, steps=3, batch=4, sampler="flow_euler", guidance=3.0)
    quantize(pipe.folder, out, QuantizeConfig(recipe=recipe_class("int8-static").with_options({}), calibration=cal,
                                              latency_runs=2, measure_memory=False))
    compile_loop(out, out, controlnets=("all",))
    q = Pipeline.from_folder(out)
    kw = dict(latents=_latents(6), steps=4, guidance=3.0, height=H, width=W, controlnets=[("all", _picture(6), 0.8)])
    fp32, host = pipe(PROMPT, **kw), q(PROMPT, **kw)
    loop = q(PROMPT, loop="loop", **kw)
    plain = q(PROMPT, **{k: v for k, v in kw.items() if k != "controlnets"})
    db, moved = psnr(host.images, fp32.images), psnr(host.images, plain.images)
    print(f"zimage controlnet int8-static vs fp32: {db:.1f} dB; vs int8 without the net {moved:.1f} dB")
    assert db >= 30 and moved < 35
    assert psnr(loop.images, host.images) >= 60


def test_zimage_controlnet_bad_requests_are_one_line(zimage_cn, tiny_zimage_diffusers, tmp_path):
    from controlnet_helpers import build_tiny_zimage_controlnet

    from onnxdiffusion.runtime.options import GenerateOptions, GenerateRequest
    from onnxdiffusion.runtime.request import plan
    from onnxdiffusion.export.controlnet import add_controlnet
    from onnxdiffusion.loopgraph.compile import compile_loop

    pipe, nets = zimage_cn
    kw = dict(steps=2, height=H, width=W)
    with pytest.raises(UserError, match="has no ControlNet 'nope'; it has all, ref"):
        pipe(PROMPT, controlnets=[("nope", _picture(1))], **kw)
    with pytest.raises(UserError, match="give residuals of different shapes"):
        pipe(PROMPT, controlnets=[("all", _picture(1)), ("ref", _picture(1))], **kw)
    with pytest.raises(UserError, match="give residuals of different shapes"):
        compile_loop(pipe.folder, tmp_path / "loop", controlnets=("all", "ref"))
    with pytest.raises(UserError, match=r"give one --control image per --controlnet \(got 0 images, 1 nets\)"):
        plan(pipe.folder, PROMPT, GenerateOptions(), GenerateRequest(controlnet=("all",)))
    with pytest.raises(UserError, match="borrows the transformer's embedders and refiners: give the diffusers folder"):
        add_controlnet(pipe.folder, nets["all"], "x", out=tmp_path / "a")
    with pytest.raises(UserError, match="is not a diffusers pipeline folder or transformer folder"):
        add_controlnet(pipe.folder, nets["all"], "x", out=tmp_path / "b", backbone=tmp_path)
    other = tmp_path / "other" / "transformer"  # another transformer's config
    other.mkdir(parents=True)
    import json

    config = json.loads((tiny_zimage_diffusers / "transformer" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "n_layers": 3}))
    with pytest.raises(UserError, match="config is not the model folder's transformer"):
        add_controlnet(pipe.folder, nets["all"], "x", out=tmp_path / "c", backbone=other.parent)
    wide = build_tiny_zimage_controlnet(tiny_zimage_diffusers, tmp_path / "wide", places=(0, 2))
    with pytest.raises(UserError, match=r"control_layers_places \[0, 2\] must name distinct main layers"):
        add_controlnet(pipe.folder, wide, "x", out=tmp_path / "d", backbone=tiny_zimage_diffusers)
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_export_takes_a_zimage_controlnet_and_reads_the_transformer_from_src(zimage_cn, tiny_zimage_diffusers, tmp_path):
    """`export SRC OUT --controlnet NAME=DIR`: the net borrows SRC's transformer; the same graph as add-controlnet's."""
    import onnx

    from onnxdiffusion.export import ExportOptions, export_pipeline

    pipe, nets = zimage_cn
    out = tmp_path / "model"
    manifest = export_pipeline(tiny_zimage_diffusers, out, ExportOptions(components=("transformer",),
                                                                        controlnets=(f"ref={nets['ref']}",)),
                               progress=False)
    entry = manifest.controlnets["ref"]
    assert entry["places"] == [0] and entry["validation"]["max_abs_error"] < 1e-3
    ours, theirs = (onnx.load(str(f / "controlnets" / "ref" / "model.onnx")) for f in (out, pipe.folder))
    assert [n.op_type for n in ours.graph.node] == [n.op_type for n in theirs.graph.node]
