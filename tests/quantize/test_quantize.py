"""quantize: recipes as typed configs, every recipe end to end on the tiny pipeline, both loop forms."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.folder.artifacts import sha256_file
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.quantize import (
    RECIPES,
    CalibrationConfig,
    Int8StaticRecipe,
    Int8TimestepRecipe,
    QuantizeConfig,
    quantize,
    recipe_class,
    recipe_from_dict,
)
from onnxdiffusion.quantize.correction import OutputCorrection, affine_explained_fraction
from onnxdiffusion.quantize.graphs import op_counts
from onnxdiffusion.quantize.timestep_graphs import merge_timestep_groups
from onnxdiffusion.runtime import Pipeline

CAL = CalibrationConfig(count=4, steps=4, batch=4)
FAST = dict(calibration=CAL, latency_runs=2, measure_memory=False)
PROMPTS = ["a red circle on the left", "a blue star at the top"]
GEN = dict(steps=4, guidance=4.0, seed=1, batch=2)


def config(recipe, **kw):
    return QuantizeConfig(recipe=recipe, **{**FAST, **kw})


# -- configs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_round_trip(name):
    recipe = recipe_class(name)()
    d = recipe.to_dict()
    assert d["name"] == name and d["version"] == type(recipe).version >= 1
    assert recipe_from_dict(json.loads(json.dumps(d))) == recipe
    cfg = QuantizeConfig(recipe=recipe, correct=name != "fp16" and recipe.quantizes_backbone)
    assert QuantizeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_options_are_parsed_by_field_type():
    r = Int8TimestepRecipe.with_options({"groups": "3", "calibrator": "entropy", "op-types": "Conv,MatMul"})
    assert r.groups == 3 and r.calibrator == "entropy" and r.op_types == ("Conv", "MatMul")


@pytest.mark.parametrize("make, fragment", [
    (lambda: recipe_class("int9"), "unknown recipe"),
    (lambda: Int8StaticRecipe.with_options({"bogus": "1"}), "unknown option 'bogus'"),
    (lambda: Int8StaticRecipe.with_options({"num_bins": "many"}), "not a valid int"),
    (lambda: Int8TimestepRecipe(groups=1), "groups (K)"),
    (lambda: Int8TimestepRecipe(groups=99), "groups (K)"),
    (lambda: Int8StaticRecipe(calibrator="entropy", aggregation="mean"), "aggregation 'mean'"),
    (lambda: CalibrationConfig(count=2), "too few calibration samples"),
    (lambda: QuantizeConfig(recipe=Int8StaticRecipe(), provider="cuda"), "cannot run on provider cuda"),
    (lambda: QuantizeConfig(recipe=recipe_class("fp16")(components=("vae_decoder",)), correct=True), "--correct"),
    (lambda: recipe_from_dict({"name": "int8-static", "version": 9}), "version 9"),
    (lambda: Int8StaticRecipe(stored="onnx"), "stored"),
    (lambda: Int8TimestepRecipe(stored="qdq"), "stored=qdq"),
])
def test_bad_configs_are_one_line_user_errors(make, fragment):
    with pytest.raises(UserError) as e:
        make()
    assert fragment in str(e.value) and "\n" not in str(e.value)


# -- the sampler-side correction --------------------------------------------------------------

def test_correction_interpolates_and_fits():
    corr = OutputCorrection(np.array([10.0, 500.0, 900.0]), np.array([0.9, 1.0, 1.1]), np.array([[1.0], [0.0], [-1.0]]))
    s, b = corr.at(500.0)
    assert s == pytest.approx(1.0) and b[0] == pytest.approx(0.0)
    s, b = corr.at(255.0)  # halfway between the first two knots
    assert s == pytest.approx(0.95, abs=1e-6) and b[0] == pytest.approx(0.5, abs=1e-6)
    assert corr.at(-5.0)[0] == pytest.approx(0.9) and corr.at(5000.0)[0] == pytest.approx(1.1)
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 3, 4, 5, 5)).astype(np.float32)
    quant = (ref - 0.2) / 1.05  # a scale and a shift the fit must undo
    fitted = OutputCorrection.fit(np.array([800.0, 100.0]), ref, quant)
    assert np.allclose(fitted.scale, 1.05, atol=1e-4) and np.allclose(fitted.bias, 0.2, atol=1e-4)
    assert OutputCorrection.from_dict(json.loads(json.dumps(fitted.to_dict()))).to_dict() == fitted.to_dict()


def test_affine_explained_fraction_separates_systematic_from_random_error():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((2, 3, 4, 5, 5))
    assert affine_explained_fraction(ref, (ref - 0.2) / 1.05) == pytest.approx(1.0, abs=1e-9)
    noisy = ref + 0.1 * rng.standard_normal(ref.shape)  # per-sample noise: no affine map helps
    assert affine_explained_fraction(ref, noisy) < 0.05
    mixed = (ref - 0.1) + 0.1 * rng.standard_normal(ref.shape)  # half bias, half noise (in MSE)
    assert 0.4 < affine_explained_fraction(ref, mixed) < 0.6


@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_correction_graph_twin_matches_host(form):
    """The Loop/unrolled graphs apply the same per-timestep correction as the host loop."""
    from test_loop_graph import SD, toy_backbone, toy_eager

    from onnxdiffusion.samplers import build_table, guided, sample
    from onnxdiffusion.loopgraph.builder import build_sampling_graph
    from onnxdiffusion.techniques.correction import CorrectionLoop

    rng = np.random.default_rng(0)
    table = build_table("dpmpp_2m", SD, 5)
    corr = OutputCorrection(np.array([100.0, 600.0, 990.0]), np.array([0.97, 1.02, 1.05]),
                            rng.normal(0, 0.05, (3, 4)).astype(np.float32))
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    uncond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    fn = corr.wrap(guided(toy_eager(toy_backbone())(np.concatenate([uncond, cond])), 3.0))
    host = sample(fn, latents, table)
    plain = sample(guided(toy_eager(toy_backbone())(np.concatenate([uncond, cond])), 3.0), latents, table)
    graph = build_sampling_graph(toy_backbone(), form, 5 if form == "unrolled" else None,
                                 techniques=[CorrectionLoop(corr)])
    feeds = {"latents": latents, "cond": cond, "uncond": uncond, "table": table.rows,
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32),
             "noise": np.zeros((1, *latents.shape), np.float32)}
    if form == "loop":
        feeds["steps"] = np.array(5, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.linalg.norm(got - host) / np.linalg.norm(host) < 1e-5
    assert np.linalg.norm(plain - host) / np.linalg.norm(host) > 1e-3  # the correction did something


# -- the timestep switch ----------------------------------------------------------------------

def _const_backbone(value: float) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["sample", "w"], ["y"]), helper.make_node("Add", ["y", "c"], ["out_sample"]),
             helper.make_node("ReduceMean", ["encoder_hidden_states"], ["unused"], keepdims=0)]
    g = helper.make_graph(nodes, "toy", [
        helper.make_tensor_value_info("sample", f, ["b", 2]), helper.make_tensor_value_info("timestep", f, ["b"]),
        helper.make_tensor_value_info("encoder_hidden_states", f, ["b", 3])],
        [helper.make_tensor_value_info("out_sample", f, ["b", 2])],
        initializer=[numpy_helper.from_array(np.full((2,), 3.0, np.float32), "w"),
                     numpy_helper.from_array(np.array(value, np.float32), "c")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_timestep_switch_picks_the_group_and_shares_weights():
    merged = merge_timestep_groups([_const_backbone(v) for v in (100.0, 200.0, 300.0)], [700.0, 300.0])
    onnx.checker.check_model(merged, full_check=True)
    assert [t.name for t in merged.graph.initializer].count("w") == 1  # identical weights stored once
    assert op_counts(merged)["If"] == 3
    sess = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones((2, 2), np.float32)
    for t, want in ((999.0, 103.0), (700.0, 103.0), (699.0, 203.0), (300.0, 203.0), (10.0, 303.0)):
        out = sess.run(None, {"sample": x, "timestep": np.full((2,), t, np.float32),
                              "encoder_hidden_states": np.zeros((2, 3), np.float32)})[0]
        assert np.allclose(out, want), (t, out)


# -- end to end on the tiny pipeline ------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_onnx):
    return Pipeline.from_folder(tiny_onnx)(PROMPTS, **GEN)


@pytest.fixture(scope="module")
def static_folder(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "static"
    report = quantize(tiny_onnx, out, config(Int8StaticRecipe(), measure_memory=True))
    return out, report


@pytest.mark.slow
def test_static_folder_manifest_and_report(static_folder, tiny_onnx, reference):
    out, report = static_folder
    manifest = json.loads((out / "manifest.json").read_text())
    q = manifest["quantization"]
    assert recipe_from_dict(q["config"]["recipe"]) == Int8StaticRecipe()
    cal = q["calibration"]
    assert cal["kind"] == "trajectories" and len(cal["prompts"]) == 4 and cal["seeds"] == [10000, 10001, 10002, 10003]
    assert cal["sampler"] == "ddim" and cal["steps"] == 4 and len(cal["timesteps"]) == 4
    assert q["source"]["unet_sha256"] == sha256_file(tiny_onnx / "unet" / "model.onnx")
    assert manifest["components"]["unet"]["precision"] == "int8-static"
    assert (out / "quantize_report.json").is_file() and "quantize_report.json" in manifest["files"]
    assert report["sizes"]["unet"]["ratio"] > 2.5
    assert report["fused_ops"]["integer_ops"].get("QLinearConv", 0) > 0
    assert report["quantized_node_count"] > 0 and "verdict" in report
    assert report["memory"]["new"]["session_mb"] > 0
    pipe = Pipeline.from_folder(out)  # hashes verified
    images = pipe(PROMPTS, **GEN).images
    assert psnr(images, reference.images) > 15


@pytest.mark.slow
def test_static_backbone_is_stored_cpu_fused_with_biases_folded(static_folder):
    out, _ = static_folder
    model = onnx.load(str(out / "unet" / "model.onnx"))
    consts = {t.name for t in model.graph.initializer}
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    ops = op_counts(model)
    assert ops["QLinearConv"] > 0 and ops["Conv"] == 0
    mm = [n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert any(len(n.input) > 6 and n.input[6] in consts for n in mm)  # the tiny UNet's linear biases
    unfolded = [n for n in model.graph.node if n.op_type == "Add"
                and any(producer.get(x) == "MatMulIntegerToFloat" for x in n.input) and any(x in consts for x in n.input)]
    assert not unfolded
    unet_entry = json.loads((out / "manifest.json").read_text())["components"]["unet"]
    assert "CPU-fused" in unet_entry["stored_as"]


@pytest.mark.slow
def test_already_quantized_is_refused_unless_forced(static_folder, tmp_path):
    out, _ = static_folder
    with pytest.raises(UserError, match="already quantized"):
        quantize(out, tmp_path / "again", config(Int8StaticRecipe()))
    assert not (tmp_path / "again").exists()
    quantize(out, tmp_path / "forced", config(recipe_class("fp16")(components=("vae_decoder",))), force=True)
    assert (tmp_path / "forced" / "manifest.json").is_file()


@pytest.mark.slow
def test_quantized_files_are_byte_identical_across_runs(tiny_onnx, tiny_int8_timestep, tmp_path):
    """Same inputs and seeds: same bytes, also from another process with another hash seed (`tiny_int8_timestep`
    is this file's `config(Int8TimestepRecipe(groups=2))`, built in-process once per run)."""
    a = tiny_int8_timestep
    env = {**os.environ, "PYTHONHASHSEED": "123", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "onnxdiffusion.cli", "quantize", str(tiny_onnx), str(tmp_path / "b"),
                           "--recipe", "int8-timestep", "-O", "groups=2", "--calib-count", "4", "--calib-steps", "4",
                           "--latency-runs", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "speed:" in proc.stdout and "int8-timestep" in proc.stdout
    for rel in ("unet/model.onnx", "manifest.json"):
        if rel == "manifest.json":
            ma, mb = (json.loads((p / rel).read_text()) for p in (a, tmp_path / "b"))
            ma["files"].pop("quantize_report.json"), mb["files"].pop("quantize_report.json")
            assert ma["files"] == mb["files"]
        else:
            assert sha256_file(a / rel) == sha256_file(tmp_path / "b" / rel)


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [
    ("int8-static", {}),
    ("int8-static", {"stored": "qdq"}),
    ("int8-naive", {}),
    ("int8-timestep", {"groups": "3"}),
    ("int8-dynamic", {}),
    ("int4-weights", {"block_size": "16"}),
    ("int4-weights", {"block_size": "16", "others": "int8"}),
    ("int4-weights", {"block_size": "16", "target_ratio": "1.21"}),  # all 4-bit: 1.23x on this conv-heavy UNet
    ("int8-static", {"attention": "int8", "norms": "int8", "smooth_alpha": "0.5"}),
    ("fp16", {"components": "unet,vae_decoder,text_encoder"}),
    ("mixed", {"target_psnr": "60", "probe_prompts": "2", "sensitivity_steps": "1", "op_types": "Conv"}),
])
def test_every_recipe_runs_and_its_loop_form_matches_the_host_loop(name, options, tiny_onnx, tmp_path, reference):
    out = tmp_path / name
    report = quantize(tiny_onnx, out, config(recipe_class(name).with_options(options)))
    assert report["latency"] and report["verdict"].startswith(("pays on cpu", "does not pay on cpu"))
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    host = pipe(PROMPTS, **GEN)
    loop = pipe(PROMPTS, loop="loop", **GEN)
    assert psnr(loop.images, host.images) >= 60
    assert psnr(host.images, reference.images) > 12
    manifest = json.loads((out / "manifest.json").read_text())
    int8_qdq = name in ("int8-static", "int8-naive", "int8-timestep", "mixed") or options.get("others") == "int8"
    assert bool(manifest["components"]["unet"].get("session_options")) == int8_qdq
    if name == "int8-timestep":
        groups = manifest["components"]["unet"]["timestep_groups"]
        assert len(groups["groups"]) == 3 and len(groups["boundaries"]) == 2
        static_bytes = report["details"]["single_group_qdq_bytes"]
        assert report["sizes"]["unet"]["bytes"] <= 1.15 * static_bytes
        body = next(n for n in onnx.load(str(out / "sampler_loop" / "model.onnx")).graph.node if n.op_type == "Loop")
        assert op_counts(body.attribute[0].g)["QLinearConv"] > 0  # the fused kernels are in the Loop body
    stored = op_counts(onnx.load(str(out / "unet" / "model.onnx")))
    if options.get("stored") == "qdq":  # portable: plain Conv between Q/DQ pairs, fused by ORT at load
        assert stored["QLinearConv"] == 0 and stored["Conv"] > 0 and stored["DequantizeLinear"] > 0
        assert "QDQ" in manifest["components"]["unet"]["stored_as"]
        # standard ops only (other providers cannot run ORT's fused attention): written out as MatMul/Softmax
        assert stored["MultiHeadAttention"] == 0 and stored["Softmax"] > 0
    elif int8_qdq:
        assert stored["QLinearConv"] > 0 and "CPU-fused" in manifest["components"]["unet"]["stored_as"]
    if name == "mixed":
        d = report["details"]
        assert d["probe"]["trace"] and "peer_hand_list" in d
        assert set(d["float_nodes"]) <= set(report["float_nodes"])
    if name == "fp16":
        assert set(report["sizes"]) == {"unet", "vae_decoder", "text_encoder"}
    if options.get("attention") == "int8":  # forced: the fused attention was decomposed and quantized
        assert report["details"]["op_groups"]["quantized"][:2] == ["attention", "norms"]
        assert stored["MultiHeadAttention"] == 0 and report["details"]["smoothing"]["weights_scaled"] > 0
    if options.get("target_ratio"):
        assert report["sizes"]["unet"]["ratio"] >= 1.21
        eight = report["details"]["weights_8bit"]["int8_weights"]
        bits = [a.i for n in onnx.load(str(out / "unet" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"
                for a in n.attribute if a.name == "bits"]
        assert eight and bits.count(8) == len(eight) and bits.count(4) > 0


@pytest.mark.slow  # 7-13 s each: the whole suite (make test) runs it, test-fast does not
@pytest.mark.parametrize("method", ["trajectory", "output"])
def test_correct_end_to_end(method, tiny_onnx, tmp_path, reference):
    out = tmp_path / "corr"
    report = quantize(tiny_onnx, out, config(Int8StaticRecipe(), correct=True, correct_method=method))
    manifest = json.loads((out / "manifest.json").read_text())
    corr = manifest["components"]["unet"]["correction"]
    assert len(corr["t"]) == CAL.steps and len(corr["bias"][0]) == 4
    assert "correction_fitted_on" in manifest["quantization"]["calibration"]
    q = report["quality"]
    if method == "output":  # least squares on the outputs cannot lose on its own data
        assert q["backbone_sqnr_corrected_db"] >= q["backbone_sqnr_db"]["mean_db"] - 1e-6
    assert "probe_psnr_corrected_db" in q
    compile_loop(out, out, form="loop")
    compile_loop(out, out, form="unrolled", steps=GEN["steps"])
    pipe = Pipeline.from_folder(out)
    assert pipe.correction is not None
    host = pipe(PROMPTS, **GEN)
    for form in ("loop", "unrolled"):
        assert psnr(pipe(PROMPTS, loop=form, **GEN).images, host.images) >= 60


# -- bad input: one line, no partial folder ------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    (dict(calibration=CalibrationConfig(count=4, prompts_file="/nonexistent/prompts.txt")), "not found"),
    (dict(calibration="EMPTY"), "is empty"),
    (dict(calibration="FEW"), "too few calibration samples"),
    (dict(recipe=Int8TimestepRecipe(groups=5)), "exceed"),
])
def test_bad_input_leaves_nothing(change, fragment, tiny_onnx, tmp_path):
    if change.get("calibration") in ("EMPTY", "FEW"):
        path = tmp_path / "prompts.txt"
        path.write_text("\n  \n" if change["calibration"] == "EMPTY" else "one\ntwo\n")
        change = dict(calibration=CalibrationConfig(count=4, steps=4, prompts_file=str(path)))
    cfg = QuantizeConfig(**{**dict(recipe=Int8StaticRecipe(), **FAST), **change})
    with pytest.raises(UserError, match=fragment):
        quantize(tiny_onnx, tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_speed_gate_fails_without_output(tiny_onnx, tmp_path, monkeypatch):
    from onnxdiffusion.quantize import api, measure

    def slow(model, manifest, components, cfg):
        return {n: {"fp32_median_ms": 1.0, "median_ms": 1.3, "ratio": 1.3, "runs": 1, "feed": {}} for n in components}

    monkeypatch.setattr(measure, "measure_latency", slow)
    with pytest.raises(api.SpeedGateError, match="does not pay on cpu") as e:
        quantize(tiny_onnx, tmp_path / "out", config(recipe_class("int8-dynamic")()), require_speedup=True)
    assert e.value.report["pays"] is False and not (tmp_path / "out").exists()
    report = quantize(tiny_onnx, tmp_path / "ok", config(recipe_class("int8-dynamic")()))
    assert report["verdict"] == "does not pay on cpu: SLOWER than fp32 (1.30x its backbone latency)"
    assert (tmp_path / "ok").is_dir()


def _cli(*args):
    """The verb in-process (run_cli_here): an interpreter start per case imported torch, ~3 CPU s each."""
    from cli_helpers import run_cli_here

    return run_cli_here("quantize", *args)


@pytest.mark.parametrize("args, fragment", [
    (["--recipe", "int9"], "unknown recipe"),
    (["--recipe", "int8-static", "-O", "bogus=1"], "unknown option"),
    (["--recipe", "int8-timestep", "-O", "groups=0"], "groups (K)"),
    (["--recipe", "int8-static", "--provider", "cuda"], "cannot run on provider cuda"),
    (["--recipe", "int8-static", "--calib-prompts", "/nonexistent.txt"], "not found"),
    (["--recipe", "int8-static", "--calib-count", "1"], "too few calibration samples"),
])
def test_cli_errors(args, fragment, tiny_onnx, tmp_path):
    proc = _cli(tiny_onnx, tmp_path / "out", *args)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_step_ranges_aggregate_and_optimal_groups():
    from onnxdiffusion.quantize.calibration import StepRanges, group_boundaries, timestep_groups

    # two regimes: wide ranges for the first 3 steps, narrow for the last 5
    hi = np.array([[8.0], [8.0], [7.0], [1.0], [1.0], [1.2], [0.9], [1.0]], np.float32)
    stats = StepRanges(["x"], -hi, hi)
    assert stats.aggregate(None, "max")["x"] == (-8.0, 8.0)
    assert stats.aggregate([3, 4], "mean")["x"] == (-1.0, 1.0)
    groups = timestep_groups(stats, 2, "optimal")
    assert groups == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert timestep_groups(stats, 2, "equal") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ts = np.array([900, 800, 700, 600, 500, 400, 300, 200], np.float32)
    assert group_boundaries(ts, groups) == [650.0]
    with pytest.raises(UserError, match="exceed"):
        timestep_groups(stats, 9)
