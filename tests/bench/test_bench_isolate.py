"""bench --quantize (quantized siblings built inside the run, cached by content hash) and --isolate (fresh
processes per variant and round, CPU time and peak RSS per phase), on the tiny model standing in for --arch sd15."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from onnxdiffusion.errors import UserError


def test_known_recipes_are_quantize_recipes():
    from onnxdiffusion.bench.variants import KNOWN_RECIPES
    from onnxdiffusion.quantize.configs import RECIPES

    assert set(KNOWN_RECIPES) == set(RECIPES)


def test_quantize_recipes_parse_and_unknown_fails():
    from onnxdiffusion.bench.quantized import parse_recipes

    assert parse_recipes(["int8-static,fp16", "int8-static"]) == ("int8-static", "fp16")
    with pytest.raises(UserError, match="unknown recipe 'int9'"):
        parse_recipes(["int8-static,int9"])


def test_content_key_follows_files_recipe_and_arguments(tiny_onnx, tmp_path):
    from onnxdiffusion.folder.artifacts import read_manifest, write_manifest
    from onnxdiffusion.bench.quantized import content_key

    key = content_key(tiny_onnx, "int8-static", ())
    assert key == content_key(tiny_onnx, "int8-static", ())
    assert key != content_key(tiny_onnx, "int8-dynamic", ())
    assert key != content_key(tiny_onnx, "int8-static", ("--calib-count", "4"))
    other = tmp_path / "m"
    shutil.copytree(tiny_onnx, other)
    assert content_key(other, "int8-static", ()) == key  # the folder's content, not its path
    draft = read_manifest(other).to_dict()
    first = next(iter(draft["files"]))
    draft["files"][first] = "0" * 64  # a different file
    write_manifest(other, draft)
    assert content_key(other, "int8-static", ()) != key


@pytest.mark.slow
def test_isolate_with_quantize_on_a_ready_arch_folder(tiny_onnx, tiny_diffusers, tmp_path):
    """The tiny model stands in for SD1.5: --quantize builds ort-int8-dynamic into WORK/quantized (reused on the
    second run), --isolate measures each variant in fresh processes over interleaved rounds."""
    from onnxdiffusion.bench import BenchOptions, run_bench

    work = tmp_path / "work"
    shutil.copytree(tiny_onnx, work / "onnx")
    shutil.copytree(tiny_diffusers, work / "diffusers")
    opts = BenchOptions(arch="sd15", work=work, variants=("ort-fp32,ort-int8-dynamic",), steps=2, repeats=2, size=64,
                        threads=1, out=tmp_path / "out", progress=False, quantize=("int8-dynamic",), isolate=True)
    results = run_bench(opts)
    made = list((work / "quantized").iterdir())
    assert len(made) == 1 and made[0].name.startswith("int8-dynamic-")
    assert results["quantized"][0]["cached"] is False
    rows = {r["name"]: r for r in results["variants"]}
    assert set(rows) == {"ort-fp32", "ort-int8-dynamic"}
    for name, row in rows.items():
        assert row["status"] == "ok", row.get("reason")
        iso = row["isolated"]
        assert iso["rounds"] == 2 and len(row["rounds"]) == 2
        assert {r["round"] for r in row["rounds"]} == {0, 1}
        assert iso["e2e_cpu_s"] > 0 and iso["step_cpu_s"] is not None and iso["load_cpu_s"] > 0
        assert set(iso["phase_peak_rss_bytes"]) == {"load", "image"}
        assert 0 < iso["phase_peak_rss_bytes"]["load"] <= iso["peak_rss_bytes"]
        pids = {r.get("pid") for r in row["rounds"]}
        assert len(pids) == 2  # a fresh process per round
    assert rows["ort-int8-dynamic"]["precision"] == "int8-dynamic"
    assert rows["ort-fp32"]["vs_reference"]["e2e_cpu"] == 1.0  # the reference here: ort-fp32 (no torch row)
    assert rows["ort-int8-dynamic"]["vs_reference"]["peak_rss"] > 0
    assert (tmp_path / "out" / "results.json").is_file() and not (tmp_path / "out" / "_isolate").exists()

    again = run_bench(opts.__class__(**{**opts.__dict__, "out": tmp_path / "out2"}))
    assert again["quantized"][0]["cached"] is True and len(list((work / "quantized").iterdir())) == 1


def test_isolate_child_failure_is_a_row_not_a_crash(tiny_onnx, tmp_path):
    from onnxdiffusion.bench.isolate import run_child
    from onnxdiffusion.bench.runners import Job
    from onnxdiffusion.bench.variants import VariantSpec

    import numpy as np

    broken = tmp_path / "broken"
    shutil.copytree(tiny_onnx, broken)
    (broken / "unet" / "model.onnx").write_bytes(b"not onnx")
    spec = VariantSpec("ort-fp32", "ort", "x", broken, steps=2)
    job = Job(["a red circle"], np.zeros((1, 4, 8, 8), np.float32), 4.0, 64, 64)
    rec = run_child(spec, job, 1, None, None, None)
    assert "error" in rec and rec["error"]


@pytest.mark.slow
def test_sd15_tiny_builder_runs_from_the_package(tmp_path):
    """The arch builders are package modules (an installed package can run them), not scripts in the checkout."""
    subprocess.run([sys.executable, "-m", "onnxdiffusion.bench.arch.sd15", "build", str(tmp_path), "--tiny"], check=True,
                   capture_output=True)
    assert (tmp_path / "diffusers" / "model_index.json").is_file()
    import json

    cfg = json.loads((tmp_path / "diffusers" / "unet" / "config.json").read_text())
    assert cfg["sample_size"] == 32 and list(cfg["block_out_channels"]) == [32, 64, 64, 64]
