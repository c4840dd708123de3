"""`generate MODEL "make the circle blue" --image in.png` on an editing model (issue 42): the CLI draws what the
Python API draws, and bad input (acceptance 5) is one error line with nothing written: no --image, --strength or
--mask, two pictures, a 16-bit picture, a picture too small; several pictures for an img2img model."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from cli_helpers import assert_one_line_error, run_cli_here
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

PROMPT = "make the circle blue"


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from tiny_kontext import picture

    d = tmp_path_factory.mktemp("edit_pictures")
    Image.fromarray(picture(60, 100, seed=3)).save(d / "in.png")
    Image.fromarray(np.zeros((60, 100), np.uint16)).save(d / "sixteen.png")
    Image.fromarray(np.zeros((2, 100, 3), np.uint8)).save(d / "thin.png")
    return d


def test_cli_edit_is_the_python_api(tiny_kontext_onnx, pictures, tmp_path):
    out = tmp_path / "out.png"
    proc = run_cli_here("generate", tiny_kontext_onnx, PROMPT, "--image", pictures / "in.png", "--steps", 3,
                        "--guidance", 2.5, "--height", 24, "--width", 40, "--seed", 5, "-o", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = Pipeline.from_folder(tiny_kontext_onnx)(PROMPT, image=np.asarray(Image.open(pictures / "in.png")), steps=3,
                                                   guidance=2.5, height=24, width=40, seed=5)
    assert psnr(np.asarray(Image.open(out))[None], want.images) == float("inf")


@pytest.mark.parametrize("args,fragments", [
    ((), ("edits a picture", "--image")),
    (("--image", "in.png", "--strength", "0.5"), ("takes no mask or strength",)),
    (("--image", "in.png", "--mask", "in.png"), ("takes no mask or strength",)),
    (("--image", "in.png", "--image", "in.png"), ("at most 1 reference",)),
    (("--image", "sixteen.png"), ("mode 'I;16'",)),
    (("--image", "thin.png"), ("is 2x100", "each side")),
])
def test_bad_edit_input_is_one_line_and_writes_nothing(tiny_kontext_onnx, pictures, tmp_path, args, fragments):
    out = tmp_path / "out.png"
    args = [pictures / a if a.endswith(".png") else a for a in args]
    proc = run_cli_here("generate", tiny_kontext_onnx, PROMPT, *args, "--steps", 1, "--height", 24, "--width", 40,
                        "-o", out)
    assert_one_line_error(proc, *fragments)
    assert not list(tmp_path.iterdir())


def test_two_start_pictures_for_an_img2img_model(tiny_onnx, pictures, tmp_path):
    proc = run_cli_here("generate", tiny_onnx, "a red ring", "--image", pictures / "in.png", "--image",
                        pictures / "in.png", "-o", tmp_path / "out.png")
    assert_one_line_error(proc, "one start picture")
    assert not list(tmp_path.iterdir())
