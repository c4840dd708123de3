"""Per-step precision schedule: step selection, manifest round trip and refusals, host loop vs graphs."""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from onnxdiffusion.folder.artifacts import read_manifest, verify_folder
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.folder.manifest import ManifestError, validate_manifest
from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize
from onnxdiffusion.quantize.schedule import PrecisionSchedule, ScheduleConfig
from onnxdiffusion.quantize.schedule_select import latency_budget, select
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.samplers import build_table, guided, sample
from onnxdiffusion.loopgraph.builder import build_sampling_graph
from onnxdiffusion.techniques.precision import ScheduleLoop

sys.path.insert(0, str(Path(__file__).parents[1]))
from cli_helpers import assert_one_line_error, run_cli_here  # noqa: E402
from test_loop_graph import SD, toy_backbone, toy_eager  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["a red circle on the left", "a blue star at the top"]


# -- selection on a case whose answer is known ---------------------------------------------------

class FakeProbe:
    """Image error = the sum of `harm` over the steps run quantized (from `start` on; before it fp32)."""

    def __init__(self, harm):
        self.harm = np.asarray(harm, float)
        self.n = len(harm)
        self.table = SimpleNamespace(timesteps=np.linspace(900, 0, self.n, dtype=np.float32), sampler="ddim")
        self.latents = np.zeros((2, 1))

    def images(self, use_high, start=0):
        low = np.array([not h for h in use_high])
        low[:start] = False
        return np.full((2,), float((self.harm * low).sum()))

    def mse(self, images):
        return images


@pytest.mark.parametrize("cfg, ms, want, reached", [
    (ScheduleConfig(target=0.75), (1.0, 1.0), [0, 2], True),        # 5/9 closed at k=1, 8/9 at k=2
    (ScheduleConfig(target=0.95), (1.0, 1.0), [0, 2, 5], True),     # 9/9 at k=3
    (ScheduleConfig(target=0.75), (1.0, 2.0), [0], False),          # budget: 0.3 * 6 * 1 / 1 = 1 step
    (ScheduleConfig(steps=2, target=0.99), (1.0, 1.0), [0, 2], False),  # fixed K: the K most sensitive
])
def test_selection_picks_the_most_harmful_steps(cfg, ms, want, reached):
    probe = FakeProbe([5, 0, 3, 0, 0, 1])
    schedule, report = select(probe, cfg, "unet_high", *ms)
    assert [s["mse"] for s in report["sensitivity_image_mse"]] == [5, 0, 3, 0, 0, 1]
    assert report["chosen"]["high_steps"] == want and report["chosen"]["target_reached"] == reached
    assert schedule.high_steps(probe.table.timesteps) == want


def test_selection_stores_nothing_when_nothing_helps():
    schedule, report = select(FakeProbe([0, 0, 0]), ScheduleConfig(), "unet_high", 1.0, 1.0)
    assert schedule is None and report["chosen"] is None


def test_latency_budget():
    assert latency_budget(10.0, 18.0, 20, 1.3) == 7  # 0.3 * 200 / 8 = 7.5
    assert latency_budget(10.0, 9.0, 20, 1.3) == 20  # the high-precision backbone is not slower
    assert latency_budget(10.0, 100.0, 20, 1.3) == 0


def test_ranges_pick_exactly_the_chosen_steps_and_the_same_stretch_at_other_step_counts():
    for sampler in ("ddim", "euler", "dpmpp_2m"):
        ts = build_table(sampler, SD, 20).timesteps
        s = PrecisionSchedule.from_steps(ts, [0, 1, 2, 9, 19], "unet_high", "fp32")
        assert s.high_steps(ts) == [0, 1, 2, 9, 19]
        assert len(s.lo) == 3  # 0-2 merged
        ts40 = build_table(sampler, SD, 40).timesteps
        h40 = s.high_steps(ts40)
        assert 0 in h40 and 39 in h40 and 10 not in h40 and 30 not in h40 and 8 <= len(h40) <= 12
        back = PrecisionSchedule.from_dict(json.loads(json.dumps(s.to_dict())))
        assert back.high_steps(ts) == s.high_steps(ts) and np.array_equal(back.lo, s.lo)


# -- configuration and manifest --------------------------------------------------------------------

@pytest.mark.parametrize("spec, want", [
    ("auto", ScheduleConfig()), ("3", ScheduleConfig(steps=3)),
    ("target=0.8,max_latency=1.2,precision=fp16", ScheduleConfig(target=0.8, max_latency=1.2, precision="fp16")),
])
def test_schedule_config_parse_and_round_trip(spec, want):
    assert ScheduleConfig.parse(spec) == want
    cfg = QuantizeConfig(recipe=Int8StaticRecipe(), schedule=want)
    assert QuantizeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("make, fragment", [
    (lambda: ScheduleConfig.parse("bogus=1"), "--precision-schedule expects"),
    (lambda: ScheduleConfig.parse("target=x"), "not a valid float"),
    (lambda: ScheduleConfig(target=0), "target must be in (0, 1]"),
    (lambda: ScheduleConfig(max_latency=0.9), "max_latency must be >= 1"),
    (lambda: ScheduleConfig(precision="int8"), "precision must be one of fp32, fp16"),
    (lambda: QuantizeConfig(recipe=Int8StaticRecipe(), correct=True, schedule=ScheduleConfig()), "alternative remedies"),
])
def test_bad_schedule_configs_are_one_line_errors(make, fragment):
    with pytest.raises(UserError) as e:
        make()
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def scheduled(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "int8-sched"
    cfg = QuantizeConfig(recipe=Int8StaticRecipe(), calibration=CalibrationConfig(count=4, steps=4, batch=4),
                         latency_runs=2, measure_memory=False, schedule=ScheduleConfig(steps=2, prompts=4))
    report = quantize(tiny_onnx, out, cfg)
    compile_loop(out, out, form="loop")
    compile_loop(out, out, form="unrolled", steps=4)
    return out, report


def test_folder_holds_both_backbones_and_validates(scheduled):
    out, report = scheduled
    manifest = read_manifest(out)
    verify_folder(out, manifest)
    entry = manifest["components"]["unet"]["precision_schedule"]
    assert entry["component"] == "unet_high" and len(entry["selected"]["high_steps"]) == 2
    assert manifest["components"]["unet_high"]["precision"] == "fp32"
    assert manifest["quantization"]["config"]["schedule"]["steps"] == 2
    r = report["precision_schedule"]
    assert len(r["sensitivity_image_mse"]) == 4 and r["chosen"]["high_steps"] == entry["selected"]["high_steps"]
    assert manifest["components"]["sampler_loop"]["scheduled"] is True


def _bad(manifest, change):
    m = copy.deepcopy(manifest)
    change(m["components"]["unet"]["precision_schedule"])
    return m


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s.update(component="unet"), "precision_schedule.component"),
    (lambda s: s.update(component="nope"), "precision_schedule.component"),
    (lambda s: s.update(component="sampler_loop"), "precision_schedule.component"),
    (lambda s: s.update(precision="int8"), "precision_schedule.precision"),
    (lambda s: s.update(ranges=[]), "precision_schedule.ranges"),
    (lambda s: s.update(ranges=[[5.0, 1.0]]), "precision_schedule.ranges[0]"),
    (lambda s: s.update(ranges=[[0.0, 10.0], [5.0, 20.0]]), "precision_schedule.ranges[1]"),
    (lambda s: s.update(ranges=[[0.0, "x"]]), "precision_schedule.ranges[0]"),
    (lambda s: s.update(selected=3), "precision_schedule.selected"),
])
def test_bad_schedule_in_manifest_is_one_line_error(scheduled, change, fragment, tmp_path):
    out, _ = scheduled
    manifest = json.loads((out / "manifest.json").read_text())
    with pytest.raises(ManifestError) as e:
        validate_manifest(_bad(manifest, change), "m")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_a_bad_schedule_before_running(tiny_onnx, tmp_path):
    proc = run_cli_here("quantize", tiny_onnx, tmp_path / "out", "--recipe", "int8-static", "--precision-schedule", "steps=-1")
    assert_one_line_error(proc, "precision schedule steps")
    assert not (tmp_path / "out").exists()
    proc = run_cli_here("quantize", tiny_onnx, tmp_path / "out", "--recipe", "int8-static", "--precision-schedule", "2", "--correct")
    assert_one_line_error(proc, "alternative remedies")


# -- host loop vs graphs ---------------------------------------------------------------------------

def test_scheduled_folder_host_loop_and_graphs_agree(scheduled):
    out, _ = scheduled
    pipe = Pipeline.from_folder(out)
    assert pipe.precision_schedule is not None
    kw = dict(steps=4, guidance=4.0, seed=1, batch=2)
    host = pipe(PROMPTS, **kw)
    for form in ("loop", "unrolled"):
        assert psnr(pipe(PROMPTS, loop=form, **kw).images, host.images) >= 60
    pipe.precision_schedule = None  # the quantized backbone alone: the high-precision steps did run
    assert not np.array_equal(pipe(PROMPTS, **kw).latents, host.latents)


@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_graph_schedule_is_the_host_loops_twin(form):
    """Two toy backbones, the schedule's If in the graph vs the host dispatch (and ONNX's reference evaluator)."""
    low, high = toy_backbone(), toy_backbone()
    w = onnx.numpy_helper.to_array(high.graph.initializer[0]) * np.float32(1.3)
    high.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "w"))
    steps, rng = 6, np.random.default_rng(0)
    table = build_table("ddim", SD, steps)
    sched = PrecisionSchedule.from_steps(table.timesteps, [0, 1, 4], "unet_high", "fp32")
    lat = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond, uncond = (rng.standard_normal((2, 3, 8), dtype=np.float32) for _ in range(2))
    ctx = np.concatenate([uncond, cond])
    low_fn, high_fn = guided(toy_eager(low)(ctx), 3.0), guided(toy_eager(high)(ctx), 3.0)
    host = sample(sched.wrap(low_fn, high_fn), lat, table)
    assert np.abs(host - sample(low_fn, lat, table)).max() > 0.1
    graph = build_sampling_graph(low, form, steps if form == "unrolled" else None, techniques=[ScheduleLoop(sched, high)])
    onnx.checker.check_model(graph, full_check=True)
    feeds = {"latents": lat, "cond": cond, "uncond": uncond, "table": table.rows, "noise": np.zeros((1, *lat.shape), np.float32),
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32)}
    if form == "loop":
        feeds["steps"] = np.array(steps, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, host, atol=1e-5)
    np.testing.assert_allclose(ReferenceEvaluator(graph).run(None, feeds)[0], host, atol=1e-4)
    with pytest.raises(ValueError, match="high-precision backbone"):
        ScheduleLoop(sched, None)


def test_mmdit_family_schedule_host_vs_loop(tiny_sd3_onnx, tmp_path):
    out = tmp_path / "sd3-sched"
    cal = CalibrationConfig(count=4, steps=3, batch=4, sampler="flow_euler")
    quantize(tiny_sd3_onnx, out, QuantizeConfig(recipe=Int8StaticRecipe(), calibration=cal, latency_runs=1,
                                                measure_memory=False, schedule=ScheduleConfig(steps=1, prompts=4)))
    assert read_manifest(out)["components"]["transformer"]["precision_schedule"]["component"] == "transformer_high"
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, sampler="flow_euler", guidance=4.0, seed=2, batch=2)
    host = pipe(PROMPTS, **kw)
    assert psnr(pipe(PROMPTS, loop="loop", **kw).images, host.images) >= 60


def test_fp16_high_precision_backbone(tiny_onnx, tmp_path):
    out = tmp_path / "fp16-high"
    cfg = QuantizeConfig(recipe=Int8StaticRecipe(), calibration=CalibrationConfig(count=4, steps=3, batch=4),
                         latency_runs=1, measure_memory=False, schedule=ScheduleConfig(steps=1, prompts=4, precision="fp16"))
    quantize(tiny_onnx, out, cfg)
    manifest = read_manifest(out)
    assert manifest["components"]["unet_high"]["precision"] == "fp16"
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in onnx.load(str(out / "unet_high" / "model.onnx")).graph.initializer)
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, guidance=4.0, seed=1, batch=2)
    assert psnr(pipe(PROMPTS, loop="loop", **kw).images, pipe(PROMPTS, **kw).images) >= 60


@pytest.mark.parametrize("fixture,sampler", [("tiny_onnx", "ddim"), ("tiny_sd3_onnx", "flow_euler")])
def test_schedule_over_a_backbone_with_float_convolutions_loop_equals_host(fixture, sampler, request, tmp_path):
    """keep_sensitive leaves the most sensitive convolutions float, and the int8 backbone then runs without
    ORT's NCHWc rewrite; ORT's disabled_optimizers do not reach the Loop's If branches, so the sampling
    graph's session and the high-precision backbone's must be set so both forms round alike."""
    out = tmp_path / "keep-sched"
    cal = CalibrationConfig(count=4, steps=4, batch=4, sampler=sampler)
    cfg = QuantizeConfig(recipe=Int8StaticRecipe(keep_sensitive=0.05), calibration=cal,
                         latency_runs=1, measure_memory=False, schedule=ScheduleConfig(steps=2, prompts=4))
    report = quantize(request.getfixturevalue(fixture), out, cfg)
    manifest = read_manifest(out)
    backbone = "unet" if "unet" in manifest["components"] else "transformer"
    assert any(n.endswith("Conv") for n in report["float_nodes"])
    assert "NchwcTransformer" in manifest["components"][backbone]["session_options"]["disabled_optimizers"]
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=4, sampler=sampler, guidance=4.0, seed=3, batch=2)
    host = pipe(PROMPTS, **kw)
    assert np.array_equal(pipe(PROMPTS, loop="loop", **kw).images, host.images)
