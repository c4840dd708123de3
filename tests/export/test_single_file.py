"""Single-file checkpoints (acceptance 3): a tiny pipeline written in the original (A1111/ComfyUI) layout,
exported with `export CKPT OUT --config DIR`, against the export of the folder it came from; pickles refused."""

import json

import pytest

from cli_helpers import assert_one_line_error, invoke
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline
from single_file_layout import write_sd1_single_file

pytestmark = pytest.mark.slow

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
    assert "from_config" not in manifest["source"]  # every weight came from the file


def test_components_the_file_lacks_come_from_config(tmp_path):
    """An SD3 file without T5 (sd3_medium_incl_clips) or with the MMDiT alone: those components' weights come from
    --config (diffusers' own advice), named in the result; a --config without them is a one-line error."""
    import shutil

    import safetensors.torch as st

    from onnxdiffusion.errors import UserError
    from onnxdiffusion.export.single_file import materialize
    from single_file_layout import build_tiny_sd3_widths, write_sd3_single_file

    src = build_tiny_sd3_widths(tmp_path / "sd3")
    full = st.load_file(write_sd3_single_file(src, tmp_path / "full.safetensors"))
    cases = {"no_t5": ("text_encoders.t5xxl.",), "mmdit_only": ("text_encoders.", "first_stage_model.")}
    for name, dropped in cases.items():
        st.save_file({k: v for k, v in full.items() if not k.startswith(dropped)}, tmp_path / f"{name}.safetensors")
    folder, from_config = materialize(tmp_path / "no_t5.safetensors", src, "sd3", tmp_path / "w1")
    assert from_config == ["text_encoder_3"]
    for sub, weights in (("text_encoder_3", "model.safetensors"), ("transformer", "diffusion_pytorch_model.safetensors")):
        a, b = st.load_file(src / sub / weights), st.load_file(folder / sub / weights)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), sub
    _, from_config = materialize(tmp_path / "mmdit_only.safetensors", src, "sd3", tmp_path / "w2")
    assert from_config == ["text_encoder", "text_encoder_2", "text_encoder_3", "vae"]
    shutil.copytree(src, tmp_path / "config")
    shutil.rmtree(tmp_path / "config" / "text_encoder_3")
    with pytest.raises(UserError, match="holds no text_encoder_3 weights and --config .* has no text_encoder_3 folder"):
        materialize(tmp_path / "no_t5.safetensors", tmp_path / "config", "sd3", tmp_path / "w3")


def test_tiny_flux_single_file_is_one_line(tiny_flux_diffusers, tmp_path):
    """diffusers 0.39's convert_flux_transformer_checkpoint_to_diffusers splits each single block's fused linear1 at
    the full model's widths (inner_dim = 3072, mlp_ratio 4: hard-coded, not read from the file or the config), so a
    narrower Flux in BFL's layout cannot be read back (docs/lora.md). The export says so in one line; the layout
    itself is right: with the width taken from the file the same converter gives back every tensor (experiments/
    single_file/README.md)."""
    from onnxdiffusion.errors import UserError
    from onnxdiffusion.export.single_file import materialize
    from single_file_layout import write_flux_single_file

    ckpt = write_flux_single_file(tiny_flux_diffusers, tmp_path / "tiny-flux.safetensors")
    with pytest.raises(UserError, match=r"tiny-flux.safetensors: diffusers could not read this checkpoint as a "
                                        r"FluxPipeline: split_with_sizes .*3072, 3072, 3072, 12288"):
        materialize(ckpt, tiny_flux_diffusers, "flux", tmp_path / "work")
