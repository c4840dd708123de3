"""Flow-matching sampler tables: parity with diffusers' FlowMatchEulerDiscreteScheduler, and the
Loop/unrolled graphs running flow tables unchanged."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift  # noqa: E402

from onnxdiffusion.samplers import (  # noqa: E402
    FLOW_SAMPLERS,
    build_table,
    calculate_shift,
    default_sampler,
    guided,
    sample,
    samplers_for,
    schedule_from_config,
    table_from_config,
)
from onnxdiffusion.loopgraph.builder import build_sampling_graph  # noqa: E402
from onnxdiffusion.samplers.schedules import FlowSchedule, NoiseSchedule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

FLOW = "FlowMatchEulerDiscreteScheduler"


from sampler_oracle import SHAPE, diffusers_trajectory, max_rel, table_trajectory  # noqa: E402


FLOW_CASES = [
    ({}, {}),
    ({"shift": 3.0}, {}),  # SD3
    ({"shift": 3.0, "shift_terminal": 0.05}, {}),
    ({"use_dynamic_shifting": True}, {"mu": 0.8}),
    ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, {"mu": 1.3}),
    ({"use_dynamic_shifting": True, "shift_terminal": 0.02}, {"mu": 1.1}),  # Qwen-Image's kind
    ({"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}, {"image_seq_len": 1024}),  # Flux
    ({"use_dynamic_shifting": True, "max_shift": 0.9, "max_image_seq_len": 8192}, {"image_seq_len": 4096, "base": True}),
]


@pytest.mark.parametrize("n", [1, 2, 4, 10, 28])
@pytest.mark.parametrize("cfg,kw", FLOW_CASES)
def test_flow_euler_matches_diffusers(cfg, kw, n):
    if n == 1 and cfg.get("shift_terminal"):  # diffusers gives NaN sigmas; we refuse
        with pytest.raises(ValueError, match="shift_terminal"):
            table_from_config({"_class_name": FLOW, **cfg}, n, mu=kw.get("mu"))
        return
    ref = FlowMatchEulerDiscreteScheduler(**cfg)
    config = {"_class_name": FLOW, **ref.config}
    mu = kw.get("mu")
    if "image_seq_len" in kw:
        mu = flux_calculate_shift(kw["image_seq_len"], ref.config.base_image_seq_len, ref.config.max_image_seq_len,
                                  ref.config.base_shift, ref.config.max_shift)
        assert calculate_shift(config, kw["image_seq_len"]) == pytest.approx(mu, rel=1e-12)
    base = np.linspace(1.0, 1 / n, n) if kw.get("base") else None  # what the Flux/Qwen pipelines pass
    rng = np.random.default_rng(n)
    x0 = rng.standard_normal(SHAPE)
    ts, states = diffusers_trajectory(ref, x0, n, mu=mu, sigmas=base)
    table = table_from_config(config, n, image_seq_len=kw.get("image_seq_len"), mu=kw.get("mu"), sigmas=base)
    assert table.sampler == "flow_euler" and table.init_scale == 1.0 and not table.needs_noise
    np.testing.assert_allclose(table.rows64[:, 0], ts, rtol=1e-6)
    assert max_rel(table_trajectory(table, x0), states) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 4, 7])
@pytest.mark.parametrize("cfg,kw", [c for c in FLOW_CASES if not c[0].get("shift_terminal")])
def test_flow_heun_steps_on_the_folders_flow_grid(cfg, kw, n):
    """flow_heun on a FlowMatchEuler folder visits the noise levels the folder's own scheduler does (dynamic shift by
    mu, base sigmas): diffusers' Heun update driven on those sigmas (flow_twins), not FlowMatchHeun's static grid."""
    from flow_twins import driven

    ref = FlowMatchEulerDiscreteScheduler(**cfg)
    config = {"_class_name": FLOW, **ref.config}
    mu = kw.get("mu")
    if "image_seq_len" in kw:
        mu = calculate_shift(config, kw["image_seq_len"])
    base = np.linspace(1.0, 1 / n, n) if kw.get("base") else None
    x0 = np.random.default_rng(n).standard_normal(SHAPE)
    ts, states = diffusers_trajectory(driven("flow_heun", ref.config), x0, n, mu=mu, sigmas=base)
    table = table_from_config(config, n, "flow_heun", mu=mu, sigmas=base)
    euler = table_from_config(config, n, mu=mu, sigmas=base)
    np.testing.assert_array_equal(table.rows64[::2, 0], euler.rows64[:, 0])  # the same levels as flow_euler's
    np.testing.assert_allclose(table.rows64[:, 0], ts, rtol=1e-6)
    assert max_rel(table_trajectory(table, x0), states) < 1e-5


def test_flow_schedule_from_config_and_defaults():
    config = {"_class_name": FLOW, "_diffusers_version": "0.30.0", "num_train_timesteps": 1000, "shift": 3.0,
              "shift_terminal": None, "use_dynamic_shifting": False}
    sched = schedule_from_config(config)
    assert isinstance(sched, FlowSchedule) and sched.shift == 3.0 and sched.shift_terminal is None
    assert default_sampler(config) == "flow_euler"
    assert samplers_for(sched) == FLOW_SAMPLERS
    assert default_sampler({"_class_name": "DDIMScheduler"}) == "ddim"
    assert isinstance(schedule_from_config({"_class_name": "DDIMScheduler"}), NoiseSchedule)
    ref = FlowMatchEulerDiscreteScheduler().config
    for k, v in FlowSchedule().to_dict().items():
        assert ref[k] == v, k


def test_flow_table_rows_are_flow_velocity_form():
    table = build_table("flow_euler", FlowSchedule(shift=3.0), 6)
    t, c_in, p, q, a, c, d, e, r, k = table.rows64.T
    s = t / 1000.0
    np.testing.assert_allclose(p, 1.0)
    np.testing.assert_allclose(q, -s, rtol=1e-6)  # D = x - sigma * v
    np.testing.assert_allclose(c_in, 1.0)
    np.testing.assert_allclose(a + c, 1.0)  # x' = (s'/s) x + (1 - s'/s) D
    assert a[-1] == 0.0 and not d.any() and not e.any() and not r.any() and not k.any()


def test_flow_errors():
    dyn = FlowSchedule(use_dynamic_shifting=True)
    with pytest.raises(ValueError, match="mu"):
        build_table("flow_euler", dyn, 10)
    with pytest.raises(ValueError, match="does not apply"):
        build_table("ddim", dyn, 10, mu=1.0)
    with pytest.raises(ValueError, match="does not apply"):
        build_table("flow_euler", NoiseSchedule(1000, 0.00085, 0.012, "scaled_linear", "epsilon"), 10)
    with pytest.raises(ValueError, match="flow-matching schedules only"):
        build_table("ddim", NoiseSchedule(1000, 0.00085, 0.012, "scaled_linear", "epsilon"), 10, mu=1.0)
    with pytest.raises(ValueError, match="spacing"):
        build_table("flow_euler", FlowSchedule(), 10, "leading")
    with pytest.raises(ValueError, match="base sigmas"):
        build_table("flow_euler", FlowSchedule(), 3, sigmas=np.array([1.0, 0.5]))
    for bad in (dict(shift=0.0), dict(time_shift_type="cubic"), dict(shift_terminal=1.5), dict(num_train_timesteps=0)):
        with pytest.raises(ValueError):
            FlowSchedule(**bad)


@pytest.mark.parametrize("form", ["loop", "unrolled"])
@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_flow_table_runs_in_loop_graphs(sampler, form):
    """The ONNX graphs run a flow table unchanged: same result as the numpy host loop."""
    from test_loop_graph import toy_backbone, toy_eager

    rng = np.random.default_rng(0)
    steps = 5
    table = build_table(sampler, FlowSchedule(use_dynamic_shifting=True, shift_terminal=0.03), steps, mu=1.0)
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    uncond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    backbone = toy_backbone()
    host = sample(guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 3.0), latents, table)
    rows = table.num_steps  # a Heun step is two rows (two model calls)
    assert rows == (2 * steps - 1 if sampler == "flow_heun" else steps)
    graph = build_sampling_graph(backbone, form, rows if form == "unrolled" else None)
    onnx.checker.check_model(graph, full_check=True)
    feeds = {"latents": latents, "cond": cond, "uncond": uncond, "table": table.rows,
             "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32),
             "noise": np.zeros((1, *latents.shape), np.float32)}
    if form == "loop":
        feeds["steps"] = np.array(rows, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.linalg.norm(got - host) / np.linalg.norm(host) < 1e-5
