"""Adaptive stopping in the Loop graph against its twin, the host loop's (both techniques/stop.py): the same
step ends both, the same latents come out, on both embedded models and the tiny families; threshold 0 is the plain Loop's image bit for bit; refusals in one line."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, invoke
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import GenerationResult, Pipeline
from onnxdiffusion.samplers.cache_math import relative_change

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SD, MMDIT = ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"
PROMPT = "a red circle above a blue square"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop_loop")
    made = {}

    def get(model: Path, stop: bool = True, cache: str | None = None) -> Path:
        key = (str(model), stop, cache)
        if key not in made:
            made[key] = root / f"{model.name}-{int(stop)}-{cache or 'plain'}"
            compile_loop(model, made[key], stop_early=stop, cache=cache)
        return made[key]

    return get


def _latents_db(got, want) -> float:
    return psnr(got, want, data_range=float(np.abs(want).max()))


def _thresholds(pipe, kw, steps: int) -> list[tuple[float, int]]:
    """Thresholds whose first stop is a step well apart from its neighbours (host and graph round the change
    alike, but not bit for bit on every backbone): (threshold, steps that must run)."""
    den = [e.denoised for e in pipe.iter_generate(PROMPT, steps=steps, **kw) if not isinstance(e, GenerationResult)]
    change = [float(relative_change(den[i], den[i - 1])) for i in range(1, steps - 1)]  # steps 1 .. steps-2
    out = []
    for k in range(1, len(change)):
        earlier = min(change[:k])
        if earlier > change[k] * 1.05:
            out.append((change[k] * 1.02, k + 2))
    return out


@pytest.mark.parametrize("model", [SD, MMDIT], ids=lambda p: p.name)
def test_loop_stops_where_the_host_does(compiled, model):
    pipe = Pipeline.from_folder(compiled(model))
    kw = dict(seed=4)
    cases = _thresholds(pipe, kw, 20)
    assert len(cases) >= 3
    for threshold, want in [*cases[::max(1, len(cases) // 3)], (1e9, 2)]:
        host = pipe(PROMPT, steps=20, stop_early=f"{threshold!r}", **kw)
        loop = pipe(PROMPT, steps=20, stop_early=f"{threshold!r}", loop="loop", **kw)
        db = _latents_db(loop.latents, host.latents)
        print(f"\n{model.name} stop {threshold:.4f}: host {host.settings['steps_run']}, Loop {loop.settings['steps_run']} "
              f"steps; Loop vs host {db:.1f} dB")
        assert host.settings["steps_run"] == loop.settings["steps_run"] == want
        assert db >= 60.0
    # MIN_STEPS in the graph too
    threshold, want = cases[0]
    got = [pipe(PROMPT, steps=20, stop_early=f"{threshold!r}:{want + 3}", loop=f, **kw).settings["steps_run"]
           for f in ("host", "loop")]
    assert got[0] == got[1] >= want + 3


@pytest.mark.parametrize("model", [SD, MMDIT], ids=lambda p: p.name)
def test_threshold_zero_is_the_plain_loop_bit_for_bit(compiled, model):
    plain = Pipeline.from_folder(compiled(model, stop=False))
    stopping = Pipeline.from_folder(compiled(model))
    kw = dict(steps=8, seed=1, loop="loop")
    want = plain(PROMPT, **kw)
    for spec in (None, "0", "0:5"):
        got = stopping(PROMPT, stop_early=spec, **kw)
        assert np.array_equal(got.latents, want.latents) and np.array_equal(got.images, want.images)
        assert got.settings["steps_run"] == 8
    assert np.array_equal(plain(PROMPT, stop_early="0", **kw).images, want.images)  # no-op on a plain graph
    with pytest.raises(UserError, match="compile-loop --stop-early") as info:
        plain(PROMPT, stop_early="0.1", **kw)
    assert "\n" not in str(info.value)


def test_from_a_picture_loop_matches_host(compiled):
    from onnxdiffusion.evaluate import scenes

    pipe = Pipeline.from_folder(compiled(SD))
    rgb = scenes.render(scenes.sample_scene(3, "heldout"))
    kw = dict(steps=20, seed=5, image=rgb, strength=0.7, stop_early="0.06")
    host, loop = pipe(PROMPT, **kw), pipe(PROMPT, loop="loop", **kw)
    assert host.settings["steps_run"] == loop.settings["steps_run"] < 14
    assert _latents_db(loop.latents, host.latents) >= 60.0


def test_compiled_with_a_cache_each_runs_alone(compiled):
    """One graph with both: caching alone and stopping alone each match the host; together they are refused."""
    pipe = Pipeline.from_folder(compiled(SD, cache="deepcache"))
    for kw in (dict(cache="deepcache:3"), dict(stop_early="0.06")):
        host, loop = pipe(PROMPT, steps=20, seed=2, **kw), pipe(PROMPT, steps=20, seed=2, loop="loop", **kw)
        assert host.settings["steps_run"] == loop.settings["steps_run"]
        assert _latents_db(loop.latents, host.latents) >= 60.0
    with pytest.raises(UserError, match="use one or the other"):
        pipe(PROMPT, steps=20, cache="deepcache:3", stop_early="0.06", loop="loop")


@pytest.mark.parametrize("fixture,kw", [
    ("tiny_onnx", dict(sampler="ddim")), ("tiny_v_onnx", dict(sampler="euler")),
    ("tiny_sdxl_onnx", dict(sampler="dpmpp_2m")), ("tiny_sd3_onnx", dict(sampler="flow_euler")),
    ("tiny_flux_onnx", dict(sampler="flow_euler", guidance=3.5, height=32, width=32)),
    ("tiny_qwenimage_onnx", dict(sampler="flow_euler", guidance=4.0, height=32, width=32))])
def test_tiny_families_loop_matches_host(fixture, kw, request, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    compile_loop(folder, folder, stop_early=True)
    pipe = Pipeline.from_folder(folder)
    kw = dict(seed=3, **kw)
    cases = _thresholds(pipe, kw, 10)
    assert cases, "no step of this trajectory is a clean first stop"
    for threshold, want in cases[:2]:
        host = pipe(PROMPT, steps=10, stop_early=f"{threshold!r}", **kw)
        loop = pipe(PROMPT, steps=10, stop_early=f"{threshold!r}", loop="loop", **kw)
        assert host.settings["steps_run"] == loop.settings["steps_run"] == want
        assert _latents_db(loop.latents, host.latents) >= 60.0


def test_compile_refusals(tmp_path):
    for kw in (dict(form="unrolled", steps=3), dict(whole=True)):
        with pytest.raises(UserError, match="--form loop") as info:
            compile_loop(SD, tmp_path / "out", stop_early=True, **kw)
        assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    assert_one_line_error(invoke("compile-loop", SD, tmp_path / "out", "--form", "unrolled", "--steps", "3",
                                 "--stop-early", timeout=300), "--stop-early")
    assert not (tmp_path / "out").exists()


def test_cli_loop_reports_the_steps(compiled, tmp_path):
    out = tmp_path / "a.png"
    r = invoke("generate", compiled(MMDIT), PROMPT, "--steps", "20", "--loop", "loop", "--stop-early", "1e9",
               "-o", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ran 2 of 20 steps (stopped early)" in r.stderr and out.exists()


def test_composes_with_a_precision_schedule(tiny_onnx, tmp_path):
    """The steps the schedule names run the high-precision backbone; the stop test reads whichever ran."""
    from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize
    from onnxdiffusion.quantize.schedule import ScheduleConfig

    out = tmp_path / "int8-sched"
    cfg = QuantizeConfig(recipe=Int8StaticRecipe(), calibration=CalibrationConfig(count=4, steps=4, batch=4),
                         latency_runs=1, measure_memory=False, schedule=ScheduleConfig(steps=2, prompts=4))
    quantize(tiny_onnx, out, cfg)
    compile_loop(out, out, stop_early=True)
    pipe = Pipeline.from_folder(out)
    assert pipe.precision_schedule is not None
    kw = dict(seed=3, sampler="ddim", guidance=4.0)
    cases = _thresholds(pipe, kw, 10)
    assert cases
    for threshold, want in cases[:2]:
        host = pipe(PROMPT, steps=10, stop_early=f"{threshold!r}", **kw)
        loop = pipe(PROMPT, steps=10, stop_early=f"{threshold!r}", loop="loop", **kw)
        assert host.settings["steps_run"] == loop.settings["steps_run"] == want
        assert _latents_db(loop.latents, host.latents) >= 60.0
