"""`onnxdiffusion bench` on the tiny fixture: every output file, skipped variants with reasons, bad input,
and the report rendered by headless Chromium (skipped with a reason where /usr/bin/chromium is absent;
`bench/install_chromium.sh` installs Debian's package).

The tiny model runs 2 prompts x 2 steps; one int8 variant is made here with ONNX Runtime's own
dynamic quantizer (the bench only sees a model folder whose manifest names a recipe), one "fp16"
folder is broken on purpose (its UNet file deleted), and one peer points at a Python that does not exist.
"""

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_cli_here

from onnxdiffusion.folder.artifacts import hash_tree, read_manifest, write_json, write_manifest
from onnxdiffusion.errors import UserError

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
VARIANTS = ("torch-fp32,torch-bf16,ort-fp32,ort-fp32-loop,ort-fp32-dpmpp,ort-int8-dynamic,ort-fp16,ort-int8-static,"
            "optimum-ort,openvino-fp32")


def _set_quantized(folder: Path, recipe: str) -> None:
    draft = read_manifest(folder).to_dict()  # the read record is frozen: edit a draft, write it with write_manifest
    draft["quantization"] = {"recipe": recipe, "note": "made by tests/bench/test_bench.py"}
    draft["files"] = hash_tree(folder)
    write_manifest(folder, draft)


@pytest.fixture(scope="module")
def bench_models(tiny_onnx, tmp_path_factory) -> Path:
    """models/base (fp32 + a Loop graph), models/base-int8 (real int8 UNet), models/base-fp16 (UNet missing)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from onnxdiffusion.loopgraph.compile import compile_loop

    root = tmp_path_factory.mktemp("bench_models")
    base = root / "base"
    shutil.copytree(tiny_onnx, base)
    compile_loop(base, base, form="loop")

    q = root / "base-int8"
    shutil.copytree(tiny_onnx, q)
    unet = q / "unet" / "model.onnx"
    tmp = q / "unet" / "int8.onnx"
    quantize_dynamic(str(unet), str(tmp), weight_type=QuantType.QInt8)
    os.replace(tmp, unet)
    _set_quantized(q, "int8-dynamic")

    broken = root / "base-fp16"
    shutil.copytree(tiny_onnx, broken)
    _set_quantized(broken, "fp16")
    (broken / "unet" / "model.onnx").unlink()
    return root


@pytest.fixture(scope="module")
def bench_run(bench_models, tmp_path_factory, monkeypatch_module):
    from onnxdiffusion.bench import BenchOptions, run_bench

    monkeypatch_module.setenv("ONNXDIFFUSION_OPENVINO_PYTHON", str(bench_models / "no-such-venv" / "bin" / "python"))
    out = tmp_path_factory.mktemp("bench_out") / "report"
    options = BenchOptions(model=bench_models / "base", variants=(VARIANTS,), steps=2, fast_steps=2, repeats=2,
                           prompts=2, batch=2, size=64, threads=1, out=out, progress=False)
    results = run_bench(options)
    return out, results


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_bench_writes_every_output(bench_run):
    out, results = bench_run
    for name in ("results.json", "results.csv", "report.html", "latency.png", "pareto.png", "error_growth.png",
                 "memory_size.png", "image_grid.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    saved = json.loads((out / "results.json").read_text())
    by = {v["name"]: v for v in saved["variants"]}
    assert list(by) == [v.strip() for v in VARIANTS.split(",")]

    for name in ("ort-fp32", "ort-fp32-loop", "ort-fp32-dpmpp", "ort-int8-dynamic", "torch-fp32", "torch-bf16"):
        v = by[name]
        assert v["status"] == "ok", (name, v["reason"])
        t = v["timing"]
        assert t["repeats"] == 2 and len(t["e2e_s"]) == 2
        assert 0 < t["e2e_median_s"] <= t["e2e_p90_s"] + 1e-12
        assert t["backbone_step_median_s"] > 0 and t["vae_median_s"] > 0 and t["text_encoder_median_s"] > 0
        assert v["size_bytes"] > 0 and v["load_s"] > 0 and v["first_call_s"] > 0
        assert v["peak_rss_bytes"] > 50 * 2**20, v["memory"]
        assert v["speedup_vs_ref"] > 0
    # diffusers' PyTorch pipeline is the reference for speed ratios and fidelity
    assert saved["speed_reference"] == "torch-fp32" and saved["fidelity_reference"] == "torch-fp32"

    q = {n: by[n]["quality"] for n in by if by[n]["status"] == "ok"}
    assert q["torch-fp32"]["psnr_db"] == "inf" and q["torch-fp32"]["final_latent_rel_l2"] == 0.0
    assert q["ort-fp32"]["psnr_db"] == "inf" or q["ort-fp32"]["psnr_db"] > 40  # our fp32 = diffusers
    assert q["ort-fp32"]["final_latent_rel_l2"] < 1e-4
    # diffusers in bfloat16: the same pipeline, rounded (not the fp32 image, not a different one)
    assert q["torch-bf16"]["psnr_db"] != "inf" and 20 < q["torch-bf16"]["psnr_db"], q["torch-bf16"]
    assert 0 < q["torch-bf16"]["final_latent_rel_l2"] < 0.1
    assert q["ort-fp32-loop"]["psnr_db"] == "inf" or q["ort-fp32-loop"]["psnr_db"] > 40
    assert 1e-4 < q["ort-int8-dynamic"]["final_latent_rel_l2"] < 1
    # per-step error curves: host loops with the reference's sampler and steps only (not the reference itself)
    assert len(q["ort-int8-dynamic"]["error_curve"]) == 2 and len(q["ort-fp32"]["error_curve"]) == 2
    assert q["ort-fp32"]["error_curve"][-1] < 1e-4 < q["ort-int8-dynamic"]["error_curve"][-1]
    assert len(q["torch-bf16"]["error_curve"]) == 2 and q["torch-bf16"]["error_curve"][-1] > 1e-4  # same sampler
    for name in ("torch-fp32", "ort-fp32-loop", "ort-fp32-dpmpp"):
        assert "error_curve" not in q[name], name
    for n in q:
        assert 0 <= q[n]["attribute_accuracy"] <= 1 and 0 <= q[n]["strict_accuracy"] <= 1
        assert q[n]["frechet_distance"] >= 0 and -1 <= q[n]["ssim"] <= 1.0000001

    # skipped, each with its reason, nothing crashed
    assert by["ort-fp16"]["status"] == "skipped" and "unet" in by["ort-fp16"]["reason"] and "missing" in by["ort-fp16"]["reason"]
    assert by["ort-int8-static"]["status"] == "skipped" and "int8-static" in by["ort-int8-static"]["reason"]
    assert by["openvino-fp32"]["status"] == "skipped" and "not installed" in by["openvino-fp32"]["reason"]
    assert by["optimum-ort"]["status"] in ("ok", "skipped")
    if by["optimum-ort"]["status"] == "ok":
        assert q["optimum-ort"]["psnr_db"] == "inf" or q["optimum-ort"]["psnr_db"] > 35
    else:
        assert "not installed" in by["optimum-ort"]["reason"]

    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["name"] for r in rows] == list(by)
    assert {r["status"] for r in rows} <= {"ok", "skipped", "failed"}
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5 and "<table id='summary'>" in html
    assert "ort-fp16" in html and "not installed" in html  # the "not run" table


def test_results_name_no_absolute_path_of_the_machine(bench_run, bench_models):
    out, _ = bench_run
    for name in ("results.json", "results.csv", "report.html"):
        text = (out / name).read_text()
        assert str(bench_models.resolve()) not in text and str(out.resolve()) not in text, name
    saved = json.loads((out / "results.json").read_text())
    assert saved["model"] == str(Path("...", bench_models.name, "base"))


JS_CHECK = """
<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var res = imgs.map(function (im) { return {id: im.id, complete: im.complete, w: im.naturalWidth, h: im.naturalHeight}; });
  var pre = document.createElement('pre');
  pre.id = 'imgcheck';
  pre.textContent = 'IMG' + 'CHECK' + JSON.stringify(res) + 'END' + 'CHECK';
  document.body.appendChild(pre);
});
</script>
"""


def _chromium(*args, timeout=120):
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", "--allow-file-access-from-files", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium not installed (bash bench/install_chromium.sh)")
def test_report_renders_in_headless_chromium(bench_run, tmp_path):
    out, _ = bench_run
    page = out / "report.html"
    checked = tmp_path / "report_check.html"  # the report plus a script that reports every image's decoded size
    checked.write_text(page.read_text().replace("</body>", JS_CHECK + "</body>"))
    proc = _chromium("--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    assert "IMGCHECK" in proc.stdout, proc.stderr[-2000:]
    found = json.loads(proc.stdout.split("IMGCHECK", 1)[1].split("ENDCHECK", 1)[0])
    ids = {x["id"] for x in found}
    assert {"latency", "pareto", "error_growth", "memory_size", "image_grid"} <= ids, found
    for x in found:
        assert x["complete"] and x["w"] > 100 and x["h"] > 100, x

    shot = out / "report_screenshot.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1400,2400", page.as_uri())
    assert shot.is_file(), proc.stderr[-2000:]
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB"))
    assert img.shape[0] >= 2000 and img.shape[1] >= 1300
    assert img.std() > 10  # not a blank page


# -- bad input ------------------------------------------------------------------------------------------
def _cli(*args):
    return run_cli_here(*args, timeout=300)


_one_line_error = assert_one_line_error


def test_unknown_variant_is_a_one_line_error(bench_models, tmp_path):
    proc = _cli("bench", bench_models / "base", "--variants", "ort-fp32,ort-int9", "--out", tmp_path / "o", "--quiet")
    _one_line_error(proc, "unknown variant 'ort-int9'")
    assert not (tmp_path / "o" / "results.json").exists()


def test_output_dir_that_is_a_file_is_a_one_line_error(bench_models, tmp_path):
    f = tmp_path / "out.txt"
    f.write_text("not a folder")
    proc = _cli("bench", bench_models / "base", "--out", f, "--quiet")
    _one_line_error(proc, "output directory is a file")
    assert f.read_text() == "not a folder"


def test_bad_numbers_fail_before_running(bench_models, tmp_path):
    from onnxdiffusion.bench import BenchOptions, run_bench

    for kw, msg in ((dict(repeats=0), "--repeats"), (dict(steps=0), "--steps"), (dict(rss="maybe"), "--rss"),
                    (dict(arch="sd9"), "--arch")):
        with pytest.raises(UserError, match=msg):
            run_bench(BenchOptions(model=bench_models / "base", out=tmp_path / "o", progress=False, **kw))


def test_nothing_runnable_is_an_error(bench_models, tmp_path):
    from onnxdiffusion.bench import BenchOptions, run_bench

    with pytest.raises(UserError, match="no variant can run"):
        run_bench(BenchOptions(model=bench_models / "base", variants=("ort-fp16,ort-int8-static",),
                               out=tmp_path / "o", progress=False))


def test_default_selection_finds_siblings_and_loop_forms(bench_models):
    from onnxdiffusion.bench.variants import PlanOptions, folder_variant, plan_variants, select, source_folder

    base = bench_models / "base"
    manifest = read_manifest(base)
    plan = plan_variants(base, manifest, source_folder(base, manifest), PlanOptions(steps=2, fast_steps=1))
    names = [s.name for s in select(plan, None)]
    assert {"torch-fp32", "ort-fp32", "ort-fp32-loop", "ort-fp32-dpmpp", "ort-int8-dynamic", "ort-fp16",
            "optimum-ort", "openvino-fp32", "openvino-int8-hybrid"} <= set(names)
    # never compiled: absent, not "skipped"; quantized + DPM++ and a broken folder's other forms: only when named
    for absent in ("torch-bf16", "ort-fp32-unrolled", "ort-int8-dynamic-loop", "ort-int8-dynamic-dpmpp", "ort-fp16-loop", "ort-fp16-dpmpp"):
        assert absent not in names
    by = {s.name: s for s in plan}
    assert "no 'loop' sampling graph" in by["ort-int8-dynamic-loop"].skip
    assert by["ort-fp16"].skip and "missing" in by["ort-fp16"].skip
    chosen = select(plan, ["ort-int8-dynamic-loop"])
    assert len(chosen) == 1 and "compile-loop" in chosen[0].skip
    # a model folder given by path
    v = folder_variant(bench_models / "base-int8", base, manifest, 2)
    assert v.name == "ort-int8-dynamic@base-int8" and v.skip is None and v.precision == "int8-dynamic"
    v = folder_variant(bench_models / "base-fp16", base, manifest, 2)
    assert "missing" in v.skip


def test_fullsize_mode_reuses_its_work_folder_and_leaves_quality_out(tiny_onnx, tiny_diffusers, tmp_path):
    """--arch sd15 on a work folder that already holds a model (the tiny one stands in for SD1.5 here)."""
    from onnxdiffusion.bench import BenchOptions, run_bench

    work = tmp_path / "work"
    shutil.copytree(tiny_onnx, work / "onnx")
    shutil.copytree(tiny_diffusers, work / "diffusers")
    out = tmp_path / "out"
    results = run_bench(BenchOptions(arch="sd15", work=work, variants=("ort-fp32,ort-fp32-dpmpp",), steps=2,
                                     repeats=1, size=64, threads=1, rss="off", out=out, progress=False))
    assert results["arch"] == "sd15" and results["settings"]["prompts"] == 0
    rows = {r["name"]: r for r in results["variants"]}
    assert rows["ort-fp32"]["status"] == "ok" and "quality" not in rows["ort-fp32"]
    assert rows["ort-fp32-dpmpp"]["steps"] == 1
    assert (out / "latency.png").is_file() and (out / "memory_size.png").is_file() and (out / "image_grid.png").is_file()
    assert not (out / "pareto.png").exists() and not (out / "error_growth.png").exists()
    assert "PSNR" not in (out / "report.html").read_text().split("<h2>Summary</h2>", 1)[1].split("</table>", 1)[0]
    assert any("repeats" in n for n in results["notes"])  # fewer than 5 repeats is flagged


def test_a_recipe_in_several_folders_is_named_by_folder(bench_models, tmp_path):
    from onnxdiffusion.bench.variants import PlanOptions, plan_variants, select

    base = tmp_path / "base"
    shutil.copytree(bench_models / "base", base)
    for name in ("qa", "qb", "other"):
        shutil.copytree(bench_models / "base-int8", tmp_path / name)
    other = read_manifest(tmp_path / "other").to_dict()
    other["pipeline"]["vae_scaling_factor"] = 0.5  # a quantized folder of some other model
    write_json(tmp_path / "other" / "manifest.json", other)
    manifest = read_manifest(base)
    plan = plan_variants(base, manifest, None, PlanOptions(steps=2, fast_steps=1))
    names = [s.name for s in select(plan, None)]
    assert "ort-int8-dynamic@qa" in names and "ort-int8-dynamic@qb" in names and "ort-int8-dynamic" not in names
    assert [s.name for s in select(plan, ["ort-int8-dynamic"])] == ["ort-int8-dynamic@qa", "ort-int8-dynamic@qb"]
    assert "no diffusers source" in next(s for s in plan if s.name == "torch-fp32").skip
    assert not any("other" in n for n in names)  # another model's folder is not listed unless named
    assert "not a variant of" in next(s for s in plan if s.name == "ort-int8-dynamic@other").skip


def test_report_can_link_its_pngs_and_grids_are_palette_pngs(tmp_path):
    """--link-images: report.html names the PNG beside it (bytes stored once); image grids are 256-colour PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from onnxdiffusion.bench.plots import _save
    from onnxdiffusion.bench.report import _img_tag

    fig, ax = plt.subplots()
    ax.imshow(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    png = tmp_path / "image_grid.png"
    _save(fig, png, palette=True)
    assert Image.open(png).mode == "P"
    linked, embedded = _img_tag(png, "grid", embed=False), _img_tag(png, "grid")
    assert 'src="image_grid.png"' in linked and "base64" not in linked
    assert "data:image/png;base64," in embedded


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_arch_mode_runs_a_flow_family_against_its_diffusers_pipeline(family, request, tmp_path):
    """--arch flux / qwenimage on a work folder holding a model (the tiny one stands in for the full-width one):
    the main rows run the folder's own sampler, and the PyTorch reference (diffusers' own pipeline, the family's
    call arguments) reproduces the ONNX Runtime image from the same latents."""
    import numpy as np

    from onnxdiffusion.bench import BenchOptions, run_bench
    from onnxdiffusion.bench.runners import Job, _PipelineCache, make_runner
    from onnxdiffusion.bench.variants import VariantSpec
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.families import get_family

    onnx_dir = request.getfixturevalue(f"tiny_{family}_onnx")
    diff_dir = request.getfixturevalue(f"tiny_{family}_diffusers")
    work = tmp_path / "work"
    shutil.copytree(onnx_dir, work / "onnx")
    shutil.copytree(diff_dir, work / "diffusers")
    results = run_bench(BenchOptions(arch=family, work=work, steps=2, repeats=1, size=32, threads=1, rss="off",
                                     out=tmp_path / "out", progress=False))
    rows = {r["name"]: r for r in results["variants"]}
    assert rows["torch-fp32"]["status"] == "ok" and rows["ort-fp32"]["status"] == "ok", rows
    assert "flow-match Euler 2" in rows["ort-fp32"]["label"] and "speedup_vs_ref" in rows["ort-fp32"]

    manifest = read_manifest(work / "onnx")
    shape = get_family(family).latent_shape(manifest["pipeline"], 1, 32, 32)
    job = Job(["a red circle"], np.random.default_rng(0).standard_normal(shape, dtype=np.float32), 4.0, 32, 32)
    torch_run = make_runner(VariantSpec("t", "torch", "t", work / "diffusers", sampler="flow_euler", steps=3), threads=1)
    ort_run = make_runner(VariantSpec("o", "ort", "o", work / "onnx", sampler="flow_euler", steps=3), threads=1,
                          cache=_PipelineCache(1, "cpu"))
    torch_run.load(), ort_run.load()
    assert psnr(torch_run.generate(job).images, ort_run.generate(job).images) >= 40.0


def test_memory_probe_takes_a_spec_larger_than_one_command_line_argument(tiny_onnx):
    """The probe's spec carries the job's latents (a 256x256 flow model's are ~350 KB of JSON, past Linux's
    128 KB limit on one argument): it goes over stdin."""
    import numpy as np

    from onnxdiffusion.bench import memory
    from onnxdiffusion.bench.variants import VariantSpec

    spec = VariantSpec("ort-fp32", "ort", "ORT", tiny_onnx, steps=1).to_dict()
    latents = np.zeros((1, 4, 8, 8), np.float32)
    spec["job"] = {"prompt": "a red circle", "latents": latents.ravel().tolist(), "shape": list(latents.shape),
                   "guidance": 4.0, "height": 32, "width": 32, "padding": "x" * 300_000}
    rec = memory.probe(spec)
    assert "error" not in rec, rec
    assert rec["peak_rss_bytes"] >= rec["baseline_rss_bytes"] > 0
