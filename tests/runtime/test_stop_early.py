"""Adaptive stopping in the host loop (techniques/stop.py): the spec, the test on the denoised estimate, the
picture decoded from it, the refusals; the CLI's flag and its report line."""

from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, invoke
from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import GenerationResult, Pipeline
from onnxdiffusion.techniques.stop import StopLoop, StopSpec, parse_stop
from onnxdiffusion.samplers.cache_math import relative_change

ROOT = Path(__file__).resolve().parents[2]
SD, MMDIT = ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"
PROMPT = "a red circle above a blue square"


@pytest.mark.parametrize("text,want", [("0.05", StopSpec(0.05, 1)), ("0.05:4", StopSpec(0.05, 4)), (" 0 ", StopSpec(0.0)),
                                       (0.1, StopSpec(0.1)), (1, StopSpec(1.0)), ("none", None), ("", None), (None, None)])
def test_parse(text, want):
    assert parse_stop(text) == want


@pytest.mark.parametrize("text,fragment", [("-0.1", ">= 0"), ("nan", "finite"), ("inf", "finite"), (float("nan"), "finite"),
                                           ("abc", "must be a number"), ("0.1:0", "MIN_STEPS must be >= 1"),
                                           ("0.1:-2", ">= 1"), ("0.1:2.5", "integer"), ("0.1:2:3", "expected"),
                                           ([0.1], "string"), (True, "string")])
def test_bad_specs_are_one_line_errors(text, fragment):
    with pytest.raises(UserError, match=fragment) as info:
        parse_stop(text)
    assert "\n" not in str(info.value)


def _events(pipe, **kw):
    events = list(pipe.iter_generate(PROMPT, steps=20, seed=3, **kw))
    assert isinstance(events[-1], GenerationResult)
    return events[:-1], events[-1]


@pytest.mark.parametrize("model", [SD, MMDIT], ids=lambda p: p.name)
def test_stop_at_the_first_step_below_the_threshold_and_decode_its_estimate(model):
    pipe = Pipeline.from_folder(model, threads=1)
    steps, full = _events(pipe)
    change = [float(relative_change(steps[i].denoised, steps[i - 1].denoised)) for i in range(1, 20)]
    # a threshold between the changes of two steps: the first step under it is where the run must end
    k = next(i for i in range(4, 18) if change[i - 1] > change[i] * 1.02 and min(change[:i]) > change[i] * 1.02)
    threshold = change[k] * 1.01
    got_steps, got = _events(pipe, stop_early=f"{threshold!r}")
    assert got.settings["steps_run"] == k + 2 == len(got_steps) < 20
    assert got_steps[-1].stopped and not any(e.stopped for e in got_steps[:-1])
    assert np.array_equal(got.latents, steps[k + 1].denoised)  # the x0 estimate of the last step that ran
    # the early picture is near the full one; the half-noised latent of that step, decoded, is far from it
    h, w = full.images.shape[1:3]
    early, noisy = psnr(got.images, full.images), psnr(pipe.decode(steps[k + 1].latents, h, w), full.images)
    print(f"\n{model.name}: stop after {k + 2} steps: {early:.1f} dB vs the full run; its x decoded: {noisy:.1f} dB")
    assert early > 20.0 and early > noisy + 3.0
    # MIN_STEPS holds the stop back
    assert pipe(PROMPT, steps=20, seed=3, stop_early=f"{threshold!r}:{k + 4}").settings["steps_run"] >= k + 4


@pytest.mark.parametrize("model", [SD, MMDIT], ids=lambda p: p.name)
def test_threshold_zero_is_bit_identical_and_runs_every_step(model):
    pipe = Pipeline.from_folder(model, threads=1)
    want = pipe(PROMPT, steps=8, seed=1)
    for spec in ("0", "0:3", 0.0):
        got = pipe(PROMPT, steps=8, seed=1, stop_early=spec)
        assert np.array_equal(got.latents, want.latents) and np.array_equal(got.images, want.images)
        assert got.settings["steps_run"] == 8
    # a huge threshold still runs at least two steps (the first has no previous estimate) and never counts the last
    assert pipe(PROMPT, steps=8, seed=1, stop_early="1e9").settings["steps_run"] == 2
    assert pipe(PROMPT, steps=2, seed=1, stop_early="1e9").settings["steps_run"] == 2


def test_step_caching_is_refused_and_a_noop_of_either_composes():
    """A cached step reuses features, so its estimate barely moves: the test would fire on it."""
    pipe = Pipeline.from_folder(SD, threads=1)
    with pytest.raises(UserError, match="use one or the other") as info:
        pipe.iter_generate(PROMPT, steps=20, cache="deepcache:3", stop_early="0.1")
    assert "\n" not in str(info.value)
    assert pipe(PROMPT, steps=20, seed=3, cache="deepcache:1", stop_early="1e9").settings["steps_run"] == 2
    cached = pipe(PROMPT, steps=8, seed=3, cache="deepcache:3")
    assert np.array_equal(pipe(PROMPT, steps=8, seed=3, cache="deepcache:3", stop_early="0").images, cached.images)


def test_refusals_are_one_line():
    pipe = Pipeline.from_folder(SD, threads=1)
    for kw, fragment in ((dict(stop_early="0.1:30"), "MIN_STEPS 30 is more than the 20 steps"),
                         (dict(stop_early="0.1", loop="unrolled"), "unrolled graph runs all its steps"),
                         (dict(stop_early="-1"), ">= 0")):
        with pytest.raises(UserError, match=fragment) as info:
            pipe.iter_generate(PROMPT, steps=20, **kw)
        assert "\n" not in str(info.value)


def test_inpainting_is_refused():
    from onnxdiffusion.evaluate import scenes

    pipe = Pipeline.from_folder(SD, threads=1)
    rgb = scenes.render(scenes.sample_scene(3, "heldout"))
    mask = np.zeros(rgb.shape[:2], np.uint8)
    mask[: rgb.shape[0] // 2] = 255
    with pytest.raises(UserError, match="not with inpainting"):
        pipe.iter_generate(PROMPT, steps=8, image=rgb, mask=mask, stop_early="0.1")
    # img2img is not inpainting: the estimate is the whole picture
    assert pipe(PROMPT, steps=20, image=rgb, strength=0.8, stop_early="1e9").settings["steps_run"] == 2


def test_cli_reports_the_steps_that_ran(tmp_path):
    out = tmp_path / "a.png"
    r = invoke("generate", SD, PROMPT, "--steps", "20", "--stop-early", "1e9", "-o", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "stop-early 1e9: ran 2 of 20 steps (stopped early)" in r.stderr and out.exists()


@pytest.mark.parametrize("spec,fragment", [("-1", ">= 0"), ("nan", "finite"), ("0.1:0", "MIN_STEPS"),
                                           ("0.1:99", "MIN_STEPS 99")])
def test_cli_bad_specs(tmp_path, spec, fragment):
    out = tmp_path / "a.png"
    assert_one_line_error(invoke("generate", SD, PROMPT, "--steps", "20", "--stop-early", spec, "-o", out,
                                 timeout=300), fragment)
    assert not out.exists()


@pytest.mark.filterwarnings("ignore:divide by zero")  # step 0: no previous estimate, 0 in the denominator
@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmpp_2m"])
def test_toy_graph_is_the_host_tests_twin(sampler):
    """build_sampling_graph(techniques=[StopLoop()]) on a toy backbone: ONNX Runtime and ONNX's reference evaluator end the
    Loop at the step the host loop's StopSpec picks, and return that step's denoised estimate."""
    import onnx
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from onnxdiffusion.samplers import build_table, guided, iter_sample
    from onnxdiffusion.loopgraph.builder import build_sampling_graph
    from test_loop_graph import SD as SCHEDULE, toy_backbone, toy_eager

    rng = np.random.default_rng(1)
    steps, backbone = 12, toy_backbone()
    table = build_table(sampler, SCHEDULE, steps)
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond, uncond = (rng.standard_normal((2, 3, 8), dtype=np.float32) for _ in range(2))
    fn = guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 3.0)
    den = [d for _, _, d in iter_sample(fn, latents, table)]
    change = [float(relative_change(den[i], den[i - 1])) for i in range(1, steps - 1)]
    graph = build_sampling_graph(backbone, "loop", techniques=[StopLoop()])
    onnx.checker.check_model(graph, full_check=True)
    sessions = [ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]),
                ReferenceEvaluator(graph)]
    names = [o.name for o in graph.graph.output]
    feeds = {"latents": latents, "cond": cond, "uncond": uncond, "table": table.rows, "steps": np.array(steps, np.int64),
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32),
             "noise": np.zeros((1, *latents.shape), np.float32)}
    plain = dict(zip(names, sessions[0].run(None, feeds)))
    assert plain["steps_run"] == steps
    k = 1 + int(np.argmin(change))  # the step with the smallest change: a threshold just above it stops there
    spec = StopSpec(float(np.float32(change[k - 1])) * 1.001, 1)
    want = next(i for i, d in enumerate(den) if spec.stops(i, steps, d, den[i - 1] if i else None))
    assert want <= k
    for sess in sessions:
        got = dict(zip(names, sess.run(None, {**feeds, "stop_threshold": np.array(spec.threshold, np.float64),
                                               "stop_min_steps": np.array(1, np.int64)})))
        assert int(got["steps_run"]) == want + 1
        np.testing.assert_allclose(got["final_latents"], den[want], rtol=1e-5, atol=1e-6)
    got = dict(zip(names, sessions[0].run(None, {**feeds, "stop_threshold": np.array(spec.threshold, np.float64),
                                                 "stop_min_steps": np.array(want + 3, np.int64)})))
    assert int(got["steps_run"]) >= min(want + 3, steps)
