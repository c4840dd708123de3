"""fixup-trt on the families whose backbone is not called "unet": the shipped MMDiT (a copy) and a tiny
Flux. Our own TensorRT-form NVFP4 and FP8 backbones are installed; the folder verifies; a TensorRT
profile on this CPU-only machine falls back to the kept fp32 backbone, saying so in one line."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cli_helpers import run_cli_here
from onnxdiffusion.folder.artifacts import read_manifest, verify_folder
from onnxdiffusion.families import get_family
from onnxdiffusion.profiles import resolve
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class

pytestmark = pytest.mark.slow

MMDIT = Path(__file__).resolve().parents[2] / "models" / "shapes-mmdit-onnx"
RECIPES = {"nvfp4": {"form": "tensorrt", "activations": "fp4"}, "fp8": {"keep_16bit": "none"}}


cli = run_cli_here  # in-process: each case ran three CLI processes


PLAIN: dict[Path, np.ndarray] = {}  # the fp32 folder's image, the same for every recipe: generated once


def plain_image(src: Path, args: list, out: Path) -> np.ndarray:
    if src not in PLAIN:
        plain = cli("generate", src, *args, "--output", out)
        assert plain.returncode == 0, plain.stderr
        PLAIN[src] = np.asarray(Image.open(out))
    return PLAIN[src]


def trt_backbone(src: Path, tmp: Path, recipe: str) -> Path:
    """The backbone file of `src` quantized by `recipe` in its TensorRT form."""
    rec = read_manifest(src).get("recommended") or {}  # both folders here are flow-matching ones
    calibration = CalibrationConfig(count=4, steps=2, batch=4, sampler=rec.get("sampler", "flow_euler"), guidance=rec.get("guidance", 4.0))
    config = QuantizeConfig(recipe=recipe_class(recipe).with_options(RECIPES[recipe]), latency_runs=1,
                            calibration=calibration, measure_memory=False)
    out = tmp / f"q-{recipe}"
    quantize(src, out, config, measure_quality=False)
    manifest = read_manifest(out)
    return out / manifest["components"][get_family(manifest.get("family")).backbone]["path"]


@pytest.fixture(params=["mmdit", "flux"])
def family_folder(request, tmp_path):
    src = MMDIT if request.param == "mmdit" else request.getfixturevalue("tiny_flux_onnx")
    return src


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fixup_trt_installs_into_a_transformer_folder(family_folder, recipe, tmp_path):
    src = family_folder
    backbone = get_family(read_manifest(src).get("family")).backbone
    assert backbone == "transformer"
    trt = trt_backbone(src, tmp_path, recipe)
    folder = tmp_path / "copy"
    shutil.copytree(src, folder)

    done = cli("fixup-trt", trt, folder)
    assert done.returncode == 0, done.stderr
    assert f"installed {recipe} backbone" in done.stdout and f"fallback {backbone}_fallback/model.onnx" in done.stdout
    manifest = read_manifest(folder)
    verify_folder(folder, manifest)  # every file hashed, the new backbone's and the fallback's included
    entry = manifest["components"][backbone]
    assert entry["precision"] == recipe and entry["requires_provider"] == "tensorrt"
    assert entry["external_data"] == [f"{backbone}/model.onnx_data"]
    assert entry["fallback"]["path"] == f"{backbone}_fallback/model.onnx"
    assert json.loads((src / "manifest.json").read_text())["files"][manifest["components"][backbone]["fallback"]["path"]
                                                                    .replace("_fallback", "")] == \
        manifest["files"][entry["fallback"]["path"]]  # the fp32 backbone, byte for byte
    if recipe == "nvfp4":
        assert entry["installed_by"]["trt_outputs_typed"] > 0

    if not resolve("tensorrt-fp8").fell_back:
        pytest.skip("this machine has TensorRT: the fallback is not exercised")
    args = ["a red circle", "--steps", "2", "--seed", "3"]
    ran = cli("generate", folder, *args, "--profile", "tensorrt-fp8", "--output", tmp_path / "trt.png")
    assert ran.returncode == 0, ran.stderr
    said = [line for line in ran.stderr.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and "fallback" in said[0] and "cpu" in said[0], ran.stderr
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "trt.png")), plain_image(src, args, tmp_path / "fp32.png"))
