"""`bench MODEL MODEL`: per-model results joined side by side (bench/compare.py). The join is checked on tiny
hand-made results (every cell traceable); one end-to-end run benches the tiny SD and the tiny SD3 model, each
with its own sampler, into one report."""

import csv
import json
import pytest

from onnxdiffusion.bench.compare import fmt_cell, join, join_files, markdown, write_joined
from onnxdiffusion.errors import UserError


def _variant(name, status="ok", reason=None, e2e=0.5, speedup=1.0, psnr=40.0, rss=100 * 2**20, size=10 * 2**20):
    return {"name": name, "label": name, "status": status, "reason": reason, "sampler": "ddim", "steps": 2,
            "timing": {"e2e_median_s": e2e} if status == "ok" else None, "speedup_vs_ref": speedup if status == "ok" else None,
            "quality": {"psnr_db": psnr, "strict_accuracy": 1.0} if status == "ok" else None,
            "peak_rss_bytes": rss, "size_bytes": size}


def _results(model, variants, ref="torch-fp32"):
    return {"model": model, "source": None, "settings": {"steps": 2, "guidance": 4.0, "prompts": 2, "repeats": 2, "threads": 1},
            "speed_reference": ref, "fidelity_reference": ref, "variants": variants, "bench_seconds": 1.0}


@pytest.fixture
def two():
    a = _results("models/a-onnx", [_variant("torch-fp32", psnr="inf"), _variant("ort-fp32", e2e=0.25, speedup=2.0, psnr=80.0),
                                   _variant("ort-int8-static", e2e=0.125, speedup=4.0, psnr=31.5),
                                   _variant("optimum-ort", e2e=0.3, speedup=1.66)])
    b = _results("models/b-onnx", [_variant("torch-fp32", psnr="inf"), _variant("ort-fp32", e2e=0.4, speedup=1.25, psnr=75.0),
                                   _variant("optimum-ort", status="failed", reason="load failed: not an SD1 folder")])
    return a, b


def test_every_variant_is_a_row_and_what_did_not_run_says_why(two):
    joined = join(list(two), ["a", "b"])
    rows = {r["name"]: r["cells"] for r in joined["rows"]}
    assert list(rows) == ["torch-fp32", "ort-fp32", "ort-int8-static", "optimum-ort"]
    assert rows["ort-fp32"]["a"]["speedup_vs_ref"] == 2.0 and rows["ort-fp32"]["b"]["e2e_median_s"] == 0.4
    assert rows["ort-int8-static"]["b"]["status"] == "absent"  # b has no such folder: a row, not dropped
    absent = fmt_cell(rows["ort-int8-static"]["b"])
    assert "no such variant for b" in absent["latency"] and absent["psnr"] == "n/a"
    assert fmt_cell(rows["optimum-ort"]["b"])["latency"] == "n/a (load failed: not an SD1 folder)"
    assert fmt_cell(rows["torch-fp32"]["a"])["psnr"] == "inf"  # results.json's 'inf' string read as a number
    cells = fmt_cell(rows["ort-int8-static"]["a"])
    assert cells == {"latency": "125 ms", "speedup": "4.00x", "psnr": "31.5 dB", "rss": "100 MiB", "size": "10.0 MiB"}
    md = markdown(joined)
    assert "| ort-int8-static | 125 ms | 4.00x | 31.5 dB | 100 MiB | 10.0 MiB | n/a (no such variant" in md


def test_joined_files_are_written_beside_each_other_with_no_machine_path(two, tmp_path):
    joined = write_joined(tmp_path / "out", join(list(two), ["a", "b"]))
    out = tmp_path / "out"
    for f in ("results.json", "results.csv", "report.md", "report.html", "compare.png"):
        assert (out / f).is_file(), f
    assert joined["files"]["compare"] == "compare.png"
    for f in ("results.json", "results.csv", "report.md", "report.html"):
        assert str(tmp_path) not in (out / f).read_text()
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 8 and {r["model"] for r in rows} == {"a", "b"}
    assert next(r for r in rows if r["variant"] == "optimum-ort" and r["model"] == "b")["status"] == "failed"
    page = (out / "report.html").read_text()
    assert 'src="compare.png"' in page and "a/report.html" in page and "n/a (load failed: not an SD1 folder)" in page
    from PIL import Image

    assert Image.open(out / "compare.png").mode == "P"  # 256 colours, like the bench's other plots


def test_join_files_takes_finished_runs_and_refuses_other_json(two, tmp_path):
    paths = []
    for name, r in zip(("a-onnx", "b-onnx"), two):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(r))
        paths.append(tmp_path / name / "results.json")
    joined = join_files(tmp_path / "both", paths)
    assert [m["name"] for m in joined["models"]] == ["a-onnx", "b-onnx"]
    assert joined["models"][0]["results"] == "a-onnx/results.json"
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(UserError, match="not a bench results.json"):
        join_files(tmp_path / "bad", [paths[0], tmp_path / "x.json"])


@pytest.mark.slow
def test_bench_of_two_models_runs_each_with_its_own_sampler(tiny_onnx, tiny_sd3_onnx, tmp_path):
    """The tiny SD (DDIM) and the tiny SD3 (its own flow-match sampler, from its manifest) in one report."""
    from onnxdiffusion.bench import BenchOptions
    from onnxdiffusion.bench.compare import run_bench_models

    options = BenchOptions(variants=("ort-fp32,optimum-ort",), steps=2, repeats=1, prompts=2, batch=2, threads=1,
                           out=tmp_path / "both", progress=False, rss="off")
    joined = run_bench_models(options, [tiny_onnx, tiny_sd3_onnx])
    names = [m["name"] for m in joined["models"]]
    assert len(names) == 2 and (tmp_path / "both" / names[0] / "results.json").is_file()
    samplers = [m["sampler"] for m in joined["models"]]
    assert samplers[0] == "ddim" and samplers[1].startswith("flow_"), samplers
    fp32 = next(r for r in joined["rows"] if r["name"] == "ort-fp32")["cells"]
    assert all(fp32[n]["status"] == "ok" and fp32[n]["e2e_median_s"] > 0 for n in names)
    peer = next(r for r in joined["rows"] if r["name"] == "optimum-ort")["cells"]
    assert peer[names[1]]["status"] == "skipped"  # a peer that cannot load an SD3 folder: n/a (why), installed or not
    assert "StableDiffusionPipeline folders only" in peer[names[1]]["reason"]
    assert (tmp_path / "both" / "report.html").is_file()
