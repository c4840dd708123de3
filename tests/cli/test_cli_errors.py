"""Bad input: one line on stderr, a non-zero exit, no traceback, nothing half-written."""

import json
import shutil
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, run_cli, run_cli_here

pytestmark = pytest.mark.slow

run = run_cli_here  # in-process; the two `*_missing_*` cases below still run a real process, exit status included


def leftovers(folder: Path, name: str) -> list[Path]:
    return [p for p in folder.iterdir() if name in p.name]


# -- export -----------------------------------------------------------------------------------

def _gguf(folder: Path, data: bytes) -> Path:
    path = folder / "model.gguf"
    path.write_bytes(data)
    return path


def test_export_crafted_gguf(tmp_path, tiny_qwenimage_diffusers):
    import struct

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 2**62)  # a key-value count no file can hold
    assert_one_line_error(run("export", _gguf(tmp_path, header + b"\0" * 64), tmp_path / "out", "--base",
                              tiny_qwenimage_diffusers), "not a readable GGUF file", "key-value count")
    for data, fragment in ((b"GGUF" + struct.pack("<I", 99) + b"\0" * 40, "version 99"), (b"GGUF\3", "shorter than")):
        assert_one_line_error(run("export", _gguf(tmp_path, data), tmp_path / "out", "--base", tiny_qwenimage_diffusers),
                              fragment)
    assert_one_line_error(run("export", _gguf(tmp_path, header), tmp_path / "out"), "give --base")
    assert_one_line_error(run("export", tiny_qwenimage_diffusers, tmp_path / "out", "--base", tiny_qwenimage_diffusers),
                          "--base is for a GGUF SRC")
    assert leftovers(tmp_path, "out") == []


def test_export_missing_source(tmp_path):
    proc = run_cli("export", tmp_path / "nope", tmp_path / "out")
    assert_one_line_error(proc, "not found")
    assert leftovers(tmp_path, "out") == []


def test_export_not_a_pipeline(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README").write_text("hello")
    proc = run("export", tmp_path / "src", tmp_path / "out")
    assert_one_line_error(proc, "not a diffusers pipeline")
    assert leftovers(tmp_path, "out") == []


def test_export_unsupported_class(tmp_path, tiny_diffusers):
    src = tmp_path / "src"
    shutil.copytree(tiny_diffusers, src)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "KandinskyPipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    proc = run("export", src, tmp_path / "out")
    assert_one_line_error(proc, "unsupported pipeline class", "KandinskyPipeline")
    assert leftovers(tmp_path, "out") == []


def test_export_missing_required_encoder(tmp_path, tiny_diffusers):
    """An SD folder labelled SDXL lacks SDXL's second text encoder: named, before anything loads."""
    src = tmp_path / "src"
    shutil.copytree(tiny_diffusers, src)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionXLPipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    proc = run("export", src, tmp_path / "out")
    assert_one_line_error(proc, "sdxl", "text_encoder_2")
    assert leftovers(tmp_path, "out") == []


def test_export_corrupt_weights_leaves_nothing(tmp_path, tiny_diffusers):
    src = tmp_path / "src"
    shutil.copytree(tiny_diffusers, src)
    (src / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
    proc = run("export", src, tmp_path / "out")
    assert_one_line_error(proc)
    assert leftovers(tmp_path, "out") == []


# -- generate: model folder problems -------------------------------------------------------------

@pytest.fixture()
def model_copy(tmp_path, tiny_onnx):
    dst = tmp_path / "model"
    shutil.copytree(tiny_onnx, dst)
    return dst


def test_generate_missing_model(tmp_path):
    proc = run_cli("generate", tmp_path / "nope", "a red circle", "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "not found")
    assert not (tmp_path / "x.png").exists()


def test_generate_missing_component(model_copy, tmp_path):
    shutil.rmtree(model_copy / "unet")
    proc = run("generate", model_copy, "a red circle", "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "unet")
    assert not (tmp_path / "x.png").exists()


def test_generate_corrupt_onnx_without_hash_check(model_copy, tmp_path):
    from onnxdiffusion.folder.artifacts import hash_tree, write_json

    (model_copy / "vae_decoder" / "model.onnx").write_bytes(b"\x08\x07not an onnx model")
    manifest = json.loads((model_copy / "manifest.json").read_text())
    manifest["files"] = hash_tree(model_copy)  # hashes agree: the loader itself must catch it
    write_json(model_copy / "manifest.json", manifest)
    proc = run("generate", model_copy, "a red circle", "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "cannot load")
    assert not (tmp_path / "x.png").exists()


def test_generate_hash_mismatch(model_copy, tmp_path):
    p = model_copy / "text_encoder" / "model.onnx"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))
    proc = run("generate", model_copy, "a red circle", "-o", tmp_path / "x.png")
    assert_one_line_error(proc, "sha256")
    assert not (tmp_path / "x.png").exists()


# -- generate: argument problems -----------------------------------------------------------------

@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--height", "36"], "multiple of"),
        (["--width", "20"], "multiple of"),
        (["--steps", "0"], "[1, 1000]"),
        (["--steps", "1001"], "[1, 1000]"),
        (["--guidance", "-1"], "guidance"),
        (["--sampler", "heun"], "unknown sampler"),
        (["--provider", "quantum"], "unknown provider"),
        (["--provider", "cuda"], "not available"),
        (["--batch", "0"], "batch"),
    ],
)
def test_generate_bad_arguments(tiny_onnx, tmp_path, args, fragment):
    proc = run("generate", tiny_onnx, "a red circle", *args, "-o", tmp_path / "x.png")
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "x.png").exists()


def test_generate_output_in_missing_directory(tiny_onnx, tmp_path):
    proc = run("generate", tiny_onnx, "a red circle", "-o", tmp_path / "missing" / "x.png")
    assert_one_line_error(proc, "does not exist")


def test_generate_overlong_prompt_warns_and_succeeds(tiny_onnx, tmp_path):
    proc = run("generate", tiny_onnx, " ".join(["a red circle"] * 20), "--steps", "2", "-o", tmp_path / "x.png")
    assert proc.returncode == 0, proc.stderr
    assert "warning: prompt truncated" in proc.stderr
    assert (tmp_path / "x.png").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]
