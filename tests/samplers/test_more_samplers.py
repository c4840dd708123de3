"""PNDM, UniPC, LCM, TCD beyond step parity (tests/samplers/test_scheduler_configs.py has that): the host loop's
float32 run of the history columns, the loop forms (LCM/TCD rows run in the graphs, PNDM/UniPC are
refused there in one line), and never-silent handling of scheduler classes without a sampler here."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_loop_graph import toy_backbone, toy_eager

from onnxdiffusion.samplers import build_table, guided, iter_sample, sample, table_from_config
from onnxdiffusion.samplers import config as sampler_config
from onnxdiffusion.loopgraph.builder import build_sampling_graph
from onnxdiffusion.samplers.schedules import NoiseSchedule

SD = NoiseSchedule(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                   prediction_type="epsilon", steps_offset=1)


def _fake(x, t):
    return np.tanh(x) * (float(t) / 1000.0) + np.float32(0.3) * np.cos(np.float32(1.7) * x) - np.float32(0.1) * x


def _float64_loop(table, x0, noise=None):
    x, hist = x0.astype(np.float64) * table.init_scale, []
    for i, row in enumerate(table.rows64):
        t, c_in, p, q, a, c, d, e, r, k = row[:10]
        out = _fake(x * c_in, t)
        den = p * x + q * out
        x = a * x + c * den + sum(co * h for co, h in zip(row[[6, *range(10, len(row))]], hist))
        x = x + (e * noise[i] if e else 0) + (k * np.clip(den, -r, r) if k else 0)
        hist = [out if table.history == "output" else den, *hist]
    return x


@pytest.mark.parametrize("sampler,steps,cols,history", [("pndm", 10, 13, "output"), ("unipc", 10, 11, "denoised"),
                                                       ("unipc", 2, 10, "denoised"), ("pndm", 1, 10, "output")])
def test_host_loop_runs_history_columns_in_float32(sampler, steps, cols, history):
    from onnxdiffusion.samplers.options import SamplerOptions

    table = build_table(sampler, SD, steps, options=SamplerOptions(skip_prk_steps=True))
    assert table.rows.shape[1] == cols and table.history == history
    assert table.host_only == (cols > 10 or history == "output")
    assert table.num_steps == steps + (sampler == "pndm" and steps > 1)
    x0 = np.random.default_rng(0).standard_normal((1, 4, 8, 8), dtype=np.float32)
    got = sample(_fake, x0, table)
    ref = _float64_loop(table, x0)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    # and each yielded D is the x0 estimate p x + q out (previews), not the history value
    events = list(iter_sample(_fake, x0, table))
    assert len(events) == table.num_steps and np.isfinite(events[-1][2]).all()


@pytest.mark.parametrize("sampler", ["lcm", "tcd"])
@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_consistency_rows_run_in_loop_graphs(sampler, form):
    steps = 4
    table = build_table(sampler, SD, steps)
    assert not table.host_only and table.needs_noise
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond, uncond = rng.standard_normal((2, 2, 3, 8), dtype=np.float32)
    noise = rng.standard_normal((steps, *latents.shape), dtype=np.float32)
    backbone = toy_backbone()
    host = sample(guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 2.0), latents, table, noise)
    graph = build_sampling_graph(backbone, form, steps if form == "unrolled" else None)
    onnx.checker.check_model(graph, full_check=True)
    feeds = {"latents": latents, "cond": cond, "uncond": uncond, "table": table.rows,
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(2.0, np.float32),
             "noise": noise}
    if form == "loop":
        feeds["steps"] = np.array(steps, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.linalg.norm(got - host) / np.linalg.norm(host) < 1e-5


def test_multistep_tables_are_refused_by_the_sampling_graphs():
    from onnxdiffusion.errors import UserError
    from onnxdiffusion.folder.manifest import Component
    from onnxdiffusion.runtime.sampling_graph import SamplingGraph

    graph = build_sampling_graph(toy_backbone(), "loop")
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    sg = SamplingGraph(session, Component.from_dict("sampler_loop", {"form": "loop", "path": "sampler_loop.onnx"}))
    table = build_table("unipc", SD, 5)
    with pytest.raises(UserError, match="unipc .*host loop") as info:
        sg.feeds(table, np.zeros((1, 4, 4, 4), np.float32), None, 1.0)
    assert "\n" not in str(info.value)


def test_unknown_scheduler_class_warns_once_naming_class_and_sampler(monkeypatch):
    monkeypatch.setattr(sampler_config, "_WARNED", set())
    cfg = {"_class_name": "LMSDiscreteScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085,
           "beta_end": 0.012}
    with pytest.warns(UserWarning, match="LMSDiscreteScheduler has no sampler here: running ddim"):
        assert table_from_config(cfg, 4).sampler == "ddim"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: quiet
        table_from_config(cfg, 4)
        assert table_from_config(cfg, 4, "euler").sampler == "euler"  # a named sampler: no warning at all
    with pytest.warns(UserWarning, match="FlowMatchLCMScheduler .* running flow_euler"):
        assert table_from_config({"_class_name": "FlowMatchLCMScheduler", "shift": 3.0}, 4).sampler == "flow_euler"


def test_foreign_schedule_class_is_refused_by_name():
    with pytest.raises(ValueError, match="EDMEulerScheduler has no sampler here") as info:
        table_from_config({"_class_name": "EDMEulerScheduler", "sigma_min": 0.002}, 4)
    assert "\n" not in str(info.value)
