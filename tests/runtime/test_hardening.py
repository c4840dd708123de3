"""Hardening behaviours that are not a refused input: defaults, modes, hashing, messages."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import warnings

import pytest

from cli_helpers import invoke

from onnxdiffusion.folder.artifacts import read_manifest, sha256_file, verify_folder


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_export_writes_0755_folders_and_0644_files(tiny_onnx):
    mask = _umask()
    assert stat.S_IMODE(tiny_onnx.stat().st_mode) == 0o755 & ~mask
    for p in tiny_onnx.rglob("*"):
        want = (0o755 if p.is_dir() else 0o644) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_generate_uses_the_models_recommended_settings():
    from onnxdiffusion.folder.paths import default_model_folder
    from onnxdiffusion.runtime.pipeline import GenerateOptions, resolve_options

    manifest = read_manifest(default_model_folder())
    assert manifest["recommended"]["guidance"] == 4.0  # what the embedded model is evaluated at
    opts = resolve_options(GenerateOptions(), manifest["recommended"])
    assert (opts.guidance, opts.steps, opts.sampler) == (4.0, 20, "ddim")
    assert resolve_options(GenerateOptions(guidance=2.0), manifest["recommended"]).guidance == 2.0
    assert resolve_options(GenerateOptions(), {}).guidance == 7.5  # a folder without recommendations


def test_untrained_size_warns(tiny_onnx):
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(tiny_onnx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe("a red circle", steps=1, height=48, width=48)
    assert any("trained size" in str(w.message) for w in caught)


def test_compile_loop_in_place_hashes_only_what_it_wrote(tiny_onnx, tmp_path):
    from onnxdiffusion.loopgraph.compile import compile_loop

    model = tmp_path / "m"
    shutil.copytree(tiny_onnx, model)
    (model / "stray.txt").write_text("not written by onnxdiffusion")
    compile_loop(model, model, form="loop")
    manifest = read_manifest(model)
    assert "stray.txt" not in manifest["files"]
    assert "sampler_loop/model.onnx" in manifest["files"]
    verify_folder(model, manifest)
    # and a copy to a new folder carries only listed files
    compile_loop(model, tmp_path / "out", form="loop")
    assert not (tmp_path / "out" / "stray.txt").exists()


def test_internal_error_is_one_line_with_a_traceback_file(monkeypatch, tiny_onnx, tmp_path):
    from onnxdiffusion.runtime import pipeline

    def boom(*a, **k):
        raise RuntimeError("simulated bug\nsecond line")

    monkeypatch.setattr(pipeline.Pipeline, "from_folder", boom)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    res = invoke("generate", tiny_onnx, "a red circle", "-o", tmp_path / "x.png")
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "RuntimeError: simulated bug" in lines[0] and "--debug" in lines[0]
    assert "Traceback" not in res.stderr
    logs = list(tmp_path.glob("onnxdiffusion-traceback-*.txt"))
    assert len(logs) == 1 and "simulated bug" in logs[0].read_text() and "Traceback" in logs[0].read_text()
    res = invoke("--debug", "generate", tiny_onnx, "a red circle", "-o", tmp_path / "x.png")
    assert res.returncode == 1 and "Traceback" in res.stderr


def test_console_hints_keep_their_brackets():
    from rich.console import Console

    from onnxdiffusion.bench.report import print_table

    buf = io.StringIO()
    results = {"model": "m", "variants": [{"name": "torch-fp32", "status": "skipped",
                                           "reason": "not installed: torch (pip install -e '.[export]')"}]}
    try:
        print_table(results, console=Console(file=buf, width=200))
    except (KeyError, TypeError):
        pytest.skip("print_table needs a fuller results dict")
    assert "pip install -e '.[export]'" in buf.getvalue()


def test_quantize_copy_is_confined(tiny_onnx, tmp_path):
    """A files key leaving the folder, with a matching hash, is refused before anything is written."""
    from onnxdiffusion.quantize import QuantizeConfig, quantize, recipe_class
    from onnxdiffusion.errors import UserError

    model = tmp_path / "d" / "m"
    shutil.copytree(tiny_onnx, model)
    victim = tmp_path / "d" / "payload.txt"
    victim.write_text("keep me")
    m = json.loads((model / "manifest.json").read_text())
    m["files"]["../payload.txt"] = sha256_file(victim)
    (model / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="inside the model folder"):
        quantize(model, tmp_path / "d" / "q", QuantizeConfig(recipe=recipe_class("int8-dynamic")()))
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["m", "payload.txt"]
