"""`generate --image --strength [--mask]`: the CLI draws what the Python API draws, and bad image input
(issue 24, acceptance 5) is one error line with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

PROMPT = "a blue circle"


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    d = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / "in.png")
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(d / "other.png")
    m = np.zeros((32, 32), np.uint8)
    m[8:24, 8:24] = 255
    Image.fromarray(m).save(d / "mask.png")
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(d / "small_mask.png")
    (d / "broken.png").write_bytes(b"not a png")
    return d


def test_cli_img2img_is_the_python_api(tiny_onnx, picture, tmp_path):
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_onnx, PROMPT, "--image", picture / "in.png", "--strength", 0.6, "--steps", 8,
                   "--sampler", "ddim", "--seed", 5, "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pipe = Pipeline.from_folder(tiny_onnx)
    want = pipe(PROMPT, image=np.asarray(Image.open(picture / "in.png")), strength=0.6, steps=8, sampler="ddim",
                seed=5)
    assert psnr(np.asarray(Image.open(out))[None], want.images) == float("inf")


def test_cli_other_size_is_resized_with_a_notice(tiny_onnx, picture, tmp_path):
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_onnx, PROMPT, "--image", picture / "other.png", "--strength", 0.5, "--steps", 4,
                   "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resized to the generation size 32x32" in proc.stderr
    assert Image.open(out).size == (32, 32)


@pytest.mark.parametrize("extra,fragments", [
    (["--strength", "0"], ["strength must be a number in (0, 1]"]),
    (["--strength", "1.5"], ["strength must be a number in (0, 1]"]),
    (["--strength", "-0.2"], ["strength must be a number in (0, 1]"]),
    (["--mask", "{d}/small_mask.png"], ["the mask is 16x16 but the image is 32x32"]),
    (["--image", "{d}/broken.png"], ["not a readable picture"]),
    (["--image", "{d}/missing.png"], ["no such file"]),
])
def test_cli_bad_image_input_is_one_line_and_writes_nothing(tiny_onnx, picture, tmp_path, extra, fragments):
    out = tmp_path / "out.png"
    args = [a.format(d=picture) for a in extra]
    if "--image" not in args:
        args = ["--image", str(picture / "in.png"), *args]
    proc = run_cli_here("generate", tiny_onnx, PROMPT, *args, "--steps", 4, "-o", out)
    assert_one_line_error(proc, *fragments)
    assert not out.exists()


def test_cli_strength_without_image_is_refused(tiny_onnx, tmp_path):
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_onnx, PROMPT, "--strength", "0.5", "-o", out)
    assert_one_line_error(proc, "need --image")
    assert not out.exists()


def test_python_api_bad_image_input(tiny_onnx):
    from onnxdiffusion.errors import UserError

    pipe = Pipeline.from_folder(tiny_onnx)
    with pytest.raises(UserError, match="strength must be"):
        pipe(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=0.0, steps=2)
    with pytest.raises(UserError, match="image latents must have shape"):
        pipe(PROMPT, image=np.zeros((1, 4, 4, 4), np.float32), strength=0.5, steps=2)
    with pytest.raises(UserError, match="leaves no step"):
        pipe(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=0.05, steps=4)
    with pytest.raises(UserError, match="mask is 8x8"):
        pipe(PROMPT, image=np.zeros((32, 32, 3), np.uint8), mask=np.zeros((8, 8), np.uint8), steps=2)
