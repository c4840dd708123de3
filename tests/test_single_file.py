"""Single-file checkpoints (acceptance 3): a tiny pipeline written in the original (A1111/ComfyUI) layout,
exported with `export CKPT OUT --config DIR`, against the export of the folder it came from; pickles refused."""

import json

import pytest

from cli_helpers import assert_one_line_error, invoke
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from single_file_layout import write_sd1_single_file

KW = dict(steps=6, seed=4, guidance=5.0)


def test_sd1_single_file_round_trip(tiny_diffusers, tiny_onnx, tmp_path):
    ckpt = write_sd1_single_file(tiny_diffusers, tmp_path / "tiny-sd1.safetensors")
    out = tmp_path / "from_ckpt"
    proc = invoke("export", ckpt, out, "--config", tiny_diffusers, "--family", "sd", timeout=600)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["path"] == "tiny-sd1.safetensors" and manifest["source"]["single_file"]
    assert not list(tmp_path.glob(".from_ckpt*"))  # the temporary diffusers folder is gone
    ours = Pipeline.from_folder(out)("a red circle on the left", **KW)
    ref = Pipeline.from_folder(tiny_onnx)("a red circle on the left", **KW)
    assert psnr(ours.images, ref.images) >= 40.0


@pytest.mark.parametrize("name, body, fragment", [
    ("model.ckpt", b"\x80\x02anything", "pickle checkpoint"),
    ("model.safetensors", b"\x80\x04\x95 pickled", "pickle checkpoint"),
    ("model.safetensors", b"plain text, not tensors at all", "not a safetensors file"),
])
def test_bad_checkpoints_are_one_line(tiny_diffusers, tmp_path, name, body, fragment):
    src = tmp_path / name
    src.write_bytes(body)
    proc = invoke("export", src, tmp_path / "out", "--config", tiny_diffusers)
    assert_one_line_error(proc, name, fragment)
    assert not (tmp_path / "out").exists()


def test_checkpoint_without_config_is_one_line(tiny_diffusers, tmp_path):
    ckpt = write_sd1_single_file(tiny_diffusers, tmp_path / "c.safetensors")
    proc = invoke("export", ckpt, tmp_path / "out")
    assert_one_line_error(proc, "c.safetensors", "--config")
    proc = invoke("export", ckpt, tmp_path / "out", "--config", tiny_diffusers, "--family", "sdxl")
    assert_one_line_error(proc, "--family sdxl")
    assert not (tmp_path / "out").exists()


def test_sdxl_single_file_round_trip(tmp_path):
    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.export.single_file import export_checkpoint
    from single_file_layout import build_tiny_sdxl_widths, write_sdxl_single_file

    src = build_tiny_sdxl_widths(tmp_path / "sdxl")
    ckpt = write_sdxl_single_file(src, tmp_path / "tiny-sdxl.safetensors")
    options = ExportOptions(skip=("vae_encoder",))
    export_pipeline(src, tmp_path / "from_folder", options, progress=False)
    manifest = export_checkpoint(ckpt, tmp_path / "from_ckpt", options, config=src, family="sdxl", progress=False)
    assert manifest["family"] == "sdxl" and manifest["source"]["single_file"]
    kw = dict(steps=5, seed=4, guidance=5.0, height=32, width=32)
    ours = Pipeline.from_folder(tmp_path / "from_ckpt")("a red circle on the left", **kw)
    ref = Pipeline.from_folder(tmp_path / "from_folder")("a red circle on the left", **kw)
    assert psnr(ours.images, ref.images) >= 40.0


def test_sd3_single_file_round_trip(tmp_path):
    """SD3 in the SAI/ComfyUI all-in-one layout (MMDiT joint_blocks with fused qkv, first_stage_model, CLIP-L, CLIP-G
    and T5 under text_encoders.*), read back by diffusers' converters."""
    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.export.single_file import export_checkpoint
    from single_file_layout import build_tiny_sd3_widths, write_sd3_single_file

    src = build_tiny_sd3_widths(tmp_path / "sd3")
    ckpt = write_sd3_single_file(src, tmp_path / "tiny-sd3.safetensors")
    options = ExportOptions(skip=("vae_encoder",), default_size=32)
    export_pipeline(src, tmp_path / "from_folder", options, progress=False)
    manifest = export_checkpoint(ckpt, tmp_path / "from_ckpt", options, config=src, family="sd3", progress=False)
    assert manifest["family"] == "sd3" and manifest["source"]["single_file"]
    kw = dict(steps=4, seed=4, guidance=5.0, height=32, width=32)
    ours = Pipeline.from_folder(tmp_path / "from_ckpt")("a red circle on the left", **kw)
    ref = Pipeline.from_folder(tmp_path / "from_folder")("a red circle on the left", **kw)
    assert psnr(ours.images, ref.images) >= 40.0
