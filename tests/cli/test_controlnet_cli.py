"""ControlNet from the command line and its bad inputs (one line, nothing written); an int8-static UNet
takes the residuals too (the cut turns its QLinearConcat skip joins back into float joins).

The verbs run in-process (cli_helpers.run_cli_here: cli.run, what `python -m onnxdiffusion.cli` calls before
sys.exit); a process per case cost an interpreter start and the torch import, more than the cases' work."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"


@pytest.fixture(scope="module")
def net(tiny_diffusers, tmp_path_factory):
    from controlnet_helpers import build_tiny_controlnet

    return build_tiny_controlnet(tiny_diffusers, tmp_path_factory.mktemp("cn") / "net")


@pytest.fixture(scope="module")
def folder(tiny_onnx, tmp_path_factory):
    """A copy of the tiny SD folder the CLI adds a ControlNet to."""
    from onnxdiffusion.folder.artifacts import derive, read_manifest

    out = tmp_path_factory.mktemp("cli_cn") / "model"
    with derive(tiny_onnx, out, read_manifest(tiny_onnx)):
        pass
    return out


@pytest.fixture(scope="module")
def control_png(tmp_path_factory):
    from controlnet_helpers import control_image

    path = tmp_path_factory.mktemp("ctl") / "control.png"
    Image.fromarray(control_image(32, 3)).save(path)
    return path


def test_add_controlnet_then_generate(folder, net, control_png, tmp_path):
    proc = run_cli_here("add-controlnet", folder, net, "--name", "edges")
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = json.loads((folder / "manifest.json").read_text())["controlnets"]["edges"]
    assert entry["family"] == "sd" and entry["validation"]["max_abs_error"] < 1e-3
    assert entry["residuals"] == [[32, 1], [32, 1], [32, 2], [64, 2]] and entry["mid"] == [64, 2]
    out = tmp_path / "cn.png"
    proc = run_cli_here("generate", folder, PROMPT, "--control", control_png, "--controlnet", "edges:0.8:0:0.9",
                   "--steps", "4", "--guidance", "4", "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pipe = Pipeline.from_folder(folder)
    want = pipe(PROMPT, steps=4, guidance=4.0, controlnets=[("edges", Image.open(control_png), 0.8, 0.0, 0.9)]).images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), want)
    # the same name again: refused without --overwrite, replaced with it
    assert_one_line_error(run_cli_here("add-controlnet", folder, net, "--name", "edges"), "already has a ControlNet")
    assert run_cli_here("add-controlnet", folder, net, "--name", "edges", "--overwrite").returncode == 0
    from onnxdiffusion.folder.artifacts import read_manifest, verify_folder

    verify_folder(folder, read_manifest(folder))


@pytest.mark.parametrize("args,fragment", [
    (["--controlnet", "edges"], "one --control image per --controlnet"),
    (["--control", "CONTROL"], "one --control image per --controlnet"),
    (["--control", "CONTROL", "--controlnet", "edges:2:0.5:0.2"], "start and end"),
    (["--control", "CONTROL", "--controlnet", "edges:x"], "must be numbers"),
    (["--control", "CONTROL", "--controlnet", "edges:1:0.2"], "NAME[:SCALE[:START:END]]"),
    (["--control", "CONTROL", "--controlnet", "nope"], "no ControlNet 'nope'"),
    (["--control", "CONTROL", "--controlnet", "edges", "--loop", "unrolled"], "not built into"),
    (["--control", "CONTROL", "--controlnet", "edges", "--cache", "deepcache:2"], "step caching"),
    (["--control", "missing.png", "--controlnet", "edges"], "no such file"),
])
def test_bad_generate_inputs_are_one_line(folder, net, control_png, tmp_path, args, fragment):
    if "controlnets" not in json.loads((folder / "manifest.json").read_text()):
        assert run_cli_here("add-controlnet", folder, net, "--name", "edges").returncode == 0
    out = tmp_path / "x.png"
    args = [str(control_png) if a == "CONTROL" else a for a in args]
    assert_one_line_error(run_cli_here("generate", folder, PROMPT, "--steps", "2", "-o", out, *args), fragment)
    assert not out.exists()


def test_bad_python_inputs(folder, net, control_png):
    from onnxdiffusion.techniques.controlnet import ControlNetSpec

    if "controlnets" not in json.loads((folder / "manifest.json").read_text()):
        assert run_cli_here("add-controlnet", folder, net, "--name", "edges").returncode == 0
    pipe = Pipeline.from_folder(folder)
    img = Image.open(control_png)
    for bad, fragment in [(ControlNetSpec("edges", img, float("nan")), "finite"),
                          (ControlNetSpec("edges", img, 1.0, 0.6, 0.6), "start and end"),
                          (ControlNetSpec("edges", None), "control image"),
                          (("edges", np.zeros((1, 3, 16, 16), np.float32)), "(1 or 1, 3, 32, 32)"),
                          (("edges", np.full((1, 3, 32, 32), 2.0, np.float32)), "[0, 1]")]:
        with pytest.raises(UserError, match=None) as e:
            pipe(PROMPT, steps=2, controlnets=[bad])
        assert fragment in str(e.value) and "\n" not in str(e.value)


def test_controlnet_of_another_family_is_refused(tiny_sdxl_diffusers, folder, tmp_path):
    from controlnet_helpers import build_tiny_controlnet

    xl = build_tiny_controlnet(tiny_sdxl_diffusers, tmp_path / "xl")
    before = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    proc = run_cli_here("add-controlnet", folder, xl, "--name", "xl")
    assert_one_line_error(proc, "for a sdxl UNet", "this folder is sd")
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == before
    # and at load: a manifest that names one anyway (edited by hand) is refused in one line
    (tmp_path / "cfg").mkdir()
    cfg = json.loads((xl / "config.json").read_text())
    from onnxdiffusion.families import get_family

    with pytest.raises(UserError, match="for a sdxl UNet"):
        get_family("sd").controlnet_record(cfg, json.loads((folder / "unet" / "config.json").read_text()),
                                           json.loads((folder / "manifest.json").read_text())["pipeline"])


def test_export_with_controlnet_option(tiny_diffusers, net, tmp_path):
    proc = run_cli_here("export", tiny_diffusers, tmp_path / "m", "--controlnet", f"edges={net}", "--skip", "vae_encoder")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "edges" in json.loads((tmp_path / "m" / "manifest.json").read_text())["controlnets"]
    assert_one_line_error(run_cli_here("export", tiny_diffusers, tmp_path / "n", "--controlnet", "edges"), "NAME=DIR")
    assert not (tmp_path / "n").exists()


def test_int8_static_unet_takes_controlnet(tiny_onnx, tiny_int8_static, net, tmp_path):
    from controlnet_helpers import control_image

    from onnxdiffusion.export.controlnet import add_controlnet

    # the shared int8-static folder (4 prompts x 3 DDIM steps, as quantized here before) stays as it is: out=
    add_controlnet(tiny_int8_static, net, "edges", out=tmp_path / "int8")
    add_controlnet(tiny_onnx, net, "edges", out=tmp_path / "fp32")
    q, f = Pipeline.from_folder(tmp_path / "int8"), Pipeline.from_folder(tmp_path / "fp32")
    img, lat = control_image(32, 8), np.random.default_rng(8).standard_normal((1, 4, 8, 8), dtype=np.float32)
    kw = dict(latents=lat, steps=6, guidance=4.0)
    plain, ctl = q(PROMPT, **kw), q(PROMPT, controlnets=[("edges", img, 0.8)], **kw)
    zero = q(PROMPT, controlnets=[("edges", img, 0.0)], **kw)
    ref = f(PROMPT, controlnets=[("edges", img, 0.8)], **kw)
    vs_fp32, moved = psnr(ctl.images, ref.images), psnr(ctl.images, plain.images)
    print(f"int8-static + ControlNet vs fp32 + ControlNet: {vs_fp32:.1f} dB; vs int8 without: {moved:.1f} dB")
    assert np.array_equal(zero.images, plain.images)
    assert moved < 35.0 and vs_fp32 > moved


def test_spec_shorthands_and_keep_column():
    from onnxdiffusion.techniques.controlnet import ControlNetSpec, keep_column, parse_cli, parse_controls

    img = np.zeros((8, 8, 3), np.uint8)
    assert parse_controls(("a", img)) == parse_controls([("a", img)]) == [ControlNetSpec("a", img)]
    assert parse_controls([("a", img, 0.5, 0.1, 0.9)])[0] == ControlNetSpec("a", img, 0.5, 0.1, 0.9)
    assert parse_cli("edges") == ("edges", 1.0, 0.0, 1.0) and parse_cli("e:0.5:0.2:0.8") == ("e", 0.5, 0.2, 0.8)
    with pytest.raises(UserError):
        parse_controls([("a", img, 1.0, 0.5)])
    for steps, s, e in ((10, 0.0, 0.45), (7, 0.3, 1.0), (25, 0.1, 0.9)):
        want = [1.0 - float(i / steps < s or (i + 1) / steps > e) for i in range(steps)]  # diffusers' controlnet_keep
        assert keep_column(ControlNetSpec("a", img, 1.0, s, e), steps).tolist() == want


def test_fp16_stored_unet_takes_controlnet(tiny_onnx, net, tmp_path):
    """A UNet whose weights are stored as float16 + Cast (relayout --storage fp16) is expanded, then cut."""
    import onnx
    from controlnet_helpers import control_image
    from onnx import numpy_helper

    from onnxdiffusion.folder.artifacts import derive, read_manifest
    from onnxdiffusion.export.controlnet import add_controlnet
    from onnxdiffusion.onnxio import fp16_storage

    m = onnx.load(str(tiny_onnx / "unet" / "model.onnx"))
    for t in m.graph.initializer:  # weights a float16 checkpoint would give
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16).astype(np.float32), t.name))
    assert fp16_storage.store(m) > 0
    with derive(tiny_onnx, tmp_path / "fp16", read_manifest(tiny_onnx), replace=["unet"]) as d:
        d.save_component("unet", m, None)
    add_controlnet(tmp_path / "fp16", net, "edges")
    pipe = Pipeline.from_folder(tmp_path / "fp16")
    img, lat = control_image(32, 9), np.random.default_rng(9).standard_normal((1, 4, 8, 8), dtype=np.float32)
    plain = pipe(PROMPT, latents=lat, steps=4, guidance=4.0)
    zero = pipe(PROMPT, latents=lat, steps=4, guidance=4.0, controlnets=[("edges", img, 0.0)])
    ctl = pipe(PROMPT, latents=lat, steps=4, guidance=4.0, controlnets=[("edges", img)])
    assert np.array_equal(zero.images, plain.images) and psnr(ctl.images, plain.images) < 35.0
