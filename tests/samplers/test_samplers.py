"""Parity of the numpy sampler tables with diffusers' schedulers, plus API checks."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import diffusers.schedulers.scheduling_euler_ancestral_discrete as _ea_mod  # noqa: E402
from diffusers import (  # noqa: E402
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)

from onnxdiffusion.samplers import (  # noqa: E402
    COLUMNS,
    DISCRETE_SAMPLERS as SAMPLERS,
    build_table,
    cfg_batch,
    cfg_combine,
    cfg_split,
    guided,
    iter_sample,
    sample,
)
from onnxdiffusion.samplers.schedules import NoiseSchedule  # noqa: E402

# diffusers 0.39 calls np.array() on torch tensors (numpy 2 copy-keyword deprecation); not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SD = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    set_alpha_to_one=False,
)
SPACINGS = ("leading", "trailing", "linspace")
PREDS = ("epsilon", "v_prediction")
STEP_SUBSET = (1, 2, 3, 7, 10, 15, 20, 25, 50)
SHAPE = (1, 4, 8, 8)
RTOL = 1e-5
EPS32 = float(np.finfo(np.float32).eps)


def _diffusers_scheduler(sampler, cfg):
    common = {k: v for k, v in cfg.items() if k != "set_alpha_to_one"}
    if sampler == "ddim":
        # Our DDIM is linear in (x, out); clipping x0 is not, so compare against clip_sample=False.
        return DDIMScheduler(**cfg, clip_sample=False)
    if sampler == "euler":
        return EulerDiscreteScheduler(**common)
    if sampler == "euler_a":
        return EulerAncestralDiscreteScheduler(**common)
    return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run_diffusers(sched, x0, outs, noise):
    """Drive sched.step with pre-drawn model outputs; returns (model inputs, states) per step."""
    x = torch.from_numpy(x0) * sched.init_noise_sigma
    inputs, states = [], []
    it = iter(noise)
    with mock.patch.object(_ea_mod, "randn_tensor", lambda *a, **k: torch.from_numpy(next(it))):
        for i, t in enumerate(sched.timesteps):
            inputs.append(sched.scale_model_input(x, t).numpy().copy())
            x = sched.step(torch.from_numpy(outs[i]), t, x).prev_sample
            states.append(x.numpy().copy())
    return inputs, states


def _exact_loop(table, x0, outs, noise):
    """The table loop in float64 on the float64 coefficients: isolates float32 roundoff."""
    x, d_prev, states = x0.astype(np.float64) * table.init_scale, 0.0, []
    for i, (_, _, p, q, a, c, d, e, _, _) in enumerate(table.rows64):
        den = p * x + q * outs[i]
        x = a * x + c * den + d * d_prev + e * noise[i]
        d_prev = den
        states.append(x)
    return states


def check_parity(sampler, cfg, n, seed=0, strict=True):
    """Trajectory parity with diffusers.

    strict: every state within RTOL of diffusers.  Otherwise each step may also differ by
    diffusers' own float32 cancellation in ``x + (x - D)/sigma * dt``, ~eps32 * |x_before| / |x_after|,
    which exceeds 1e-5 by itself when sigma_max >> 15 (linear: 157, cosine: 2e4) and Euler jumps
    to sigma ~ 0 in one step.  Either way our float32 loop must stay within 1e-6 of float64 math.
    """
    sched = _diffusers_scheduler(sampler, cfg)
    sched.set_timesteps(n)
    table = build_table(sampler, NoiseSchedule(**cfg), n)

    np.testing.assert_array_equal(table.timesteps, sched.timesteps.numpy().astype(np.float32))
    assert table.init_scale == pytest.approx(float(sched.init_noise_sigma), rel=1e-6)

    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(SHAPE, dtype=np.float32)
    outs = rng.standard_normal((n, *SHAPE), dtype=np.float32)
    noise = rng.standard_normal((n, *SHAPE), dtype=np.float32)
    ref_in, ref_x = _run_diffusers(sched, x0, outs, noise)
    exact = _exact_loop(table, x0, outs, noise)

    seen_in, seen_t = [], []

    def model_fn(x_scaled, t):
        seen_in.append(x_scaled)
        seen_t.append(t)
        return outs[len(seen_t) - 1]

    before, tol_in, slack = np.linalg.norm(x0) * table.init_scale, RTOL, 0.0
    for i, x, _ in iter_sample(model_fn, x0, table, noise if table.needs_noise else None):
        # The model input at step i is the state after step i-1: same tolerance as that state.
        assert _rel(seen_in[i], ref_in[i]) < tol_in, f"model input differs at step {i}"
        after = np.linalg.norm(ref_x[i])
        if not strict:  # diffusers' roundoff is carried into later states, so it accumulates
            slack += 8 * EPS32 * before / after
        tol = RTOL + slack
        assert _rel(x, ref_x[i]) < tol, f"state differs at step {i}: {_rel(x, ref_x[i]):.2e} >= {tol:.2e}"
        assert _rel(x, exact[i]) < 1e-6, f"float32 loop drifts at step {i}: {_rel(x, exact[i]):.2e}"
        before, tol_in = after, tol
    assert len(seen_t) == n
    np.testing.assert_array_equal(np.float32(seen_t), sched.timesteps.numpy().astype(np.float32))


# --- parity sweeps ------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 51))
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_parity_every_step_count(sampler, spacing, n):
    check_parity(sampler, dict(SD, prediction_type="epsilon", timestep_spacing=spacing), n)


@pytest.mark.parametrize("n", STEP_SUBSET)
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_parity_v_prediction(sampler, spacing, n):
    check_parity(sampler, dict(SD, prediction_type="v_prediction", timestep_spacing=spacing), n, seed=1)


@pytest.mark.parametrize("n", (1, 2, 7, 25, 50))
@pytest.mark.parametrize("pred", PREDS)
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_parity_linear_no_offset_alpha_one(sampler, spacing, pred, n):
    cfg = dict(SD, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", steps_offset=0,
               set_alpha_to_one=True, prediction_type=pred, timestep_spacing=spacing)
    check_parity(sampler, cfg, n, seed=2, strict=False)


@pytest.mark.parametrize("n", (1, 2, 10, 50))
@pytest.mark.parametrize("pred", PREDS)
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_parity_squaredcos(sampler, spacing, pred, n):
    cfg = dict(SD, beta_schedule="squaredcos_cap_v2", prediction_type=pred, timestep_spacing=spacing)
    check_parity(sampler, cfg, n, seed=3, strict=False)


@pytest.mark.parametrize("sampler", ("euler", "euler_a"))
def test_euler_v_prediction_huge_sigma_is_exact(sampler):
    # One step from sigma ~ 2e4 to 0: the table gives x = D exactly (a=0, c=1), while
    # diffusers computes x + (x - D)/sigma * (0 - sigma) in float32.  Check ours against float64 math.
    sched = NoiseSchedule(**dict(SD, beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction",
                                 timestep_spacing="trailing"))
    table = build_table(sampler, sched, 1)
    s = sched.sigmas[999]
    assert s > 1e4 and table.init_scale == pytest.approx(s)
    rng = np.random.default_rng(4)
    x0, v = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    x = np.float32(x0) * np.float32(table.init_scale)
    want = x.astype(np.float64) / (s * s + 1) - s / np.sqrt(s * s + 1) * np.float32(v)
    got = sample(lambda xs, t: np.float32(v), np.float32(x0), table,
                 noise=np.zeros((1, *SHAPE), np.float32) if table.needs_noise else None)
    assert _rel(got, want) < 1e-6


# --- diffusers quirks ---------------------------------------------------------------------

@pytest.mark.parametrize("sampler", SAMPLERS)
def test_trailing_extra_timestep_is_dropped(sampler):
    # np.arange(1000, 0, -1000/61) has 62 entries; diffusers then runs 62 steps, the last at t=-1.
    cfg = dict(SD, prediction_type="epsilon", timestep_spacing="trailing")
    ref = _diffusers_scheduler(sampler, cfg)
    ref.set_timesteps(61)
    ref_t = ref.timesteps.numpy().astype(np.float32)
    assert len(ref_t) == 62 and ref_t[-1] == -1
    table = build_table(sampler, NoiseSchedule(**cfg), 61)
    assert table.num_steps == 61
    np.testing.assert_array_equal(table.timesteps, ref_t[:61])


def test_ddim_steps_to_t_minus_stride_not_next_timestep():
    # diffusers' DDIM targets t - T//n even when the grid is not uniform (linspace/trailing).
    sched = NoiseSchedule(**dict(SD, prediction_type="epsilon", timestep_spacing="linspace"))
    table = build_table("ddim", sched, 3)
    np.testing.assert_array_equal(table.timesteps, [999, 500, 0])
    ac = sched.alphas_cumprod
    a = table.rows64[:, COLUMNS.index("a")]
    assert a[0] == pytest.approx(np.sqrt(1 - ac[666]) / np.sqrt(1 - ac[999]))
    assert a[1] == pytest.approx(np.sqrt(1 - ac[167]) / np.sqrt(1 - ac[500]))


def test_out_of_range_timesteps_raise():
    sched = NoiseSchedule(**dict(SD, prediction_type="epsilon"))  # steps_offset=1
    with pytest.raises(ValueError, match="timesteps"):
        build_table("ddim", sched, 1000, "leading")  # would reach t=1000
    with pytest.raises(ValueError, match="timesteps"):
        build_table("dpmpp_2m", sched, 1000, "linspace")  # duplicate timesteps
    assert build_table("ddim", sched, 1000, "trailing").num_steps == 1000


# --- schedule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("beta_schedule,start,end", [
    ("scaled_linear", 0.00085, 0.012), ("linear", 0.0001, 0.02), ("squaredcos_cap_v2", 0.0001, 0.02)])
def test_schedule_matches_diffusers_bitwise(beta_schedule, start, end):
    ns = NoiseSchedule(1000, start, end, beta_schedule, "epsilon")
    ref = DDIMScheduler(beta_start=start, beta_end=end, beta_schedule=beta_schedule)
    assert ns.betas.dtype == ns.alphas_cumprod.dtype == ns.sigmas.dtype == np.float64
    np.testing.assert_array_equal(ns.betas.astype(np.float32), ref.betas.numpy())
    np.testing.assert_array_equal(ns.alphas_cumprod.astype(np.float32), ref.alphas_cumprod.numpy())
    np.testing.assert_allclose(ns.sigmas, np.sqrt((1 - ns.alphas_cumprod) / ns.alphas_cumprod))


def test_from_scheduler_config():
    sd15 = {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
            "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
            "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True,
            "steps_offset": 1, "trained_betas": None}
    ns = NoiseSchedule.from_scheduler_config(sd15)
    assert ns == NoiseSchedule(**dict(SD, prediction_type="epsilon", timestep_spacing="leading"))
    assert NoiseSchedule(**ns.to_dict()) == ns

    d = NoiseSchedule.from_scheduler_config({})
    ref = DDIMScheduler().config
    for k, v in d.to_dict().items():
        assert ref[k] == v, k

    for bad in ({"trained_betas": [0.1] * 10}, {"prediction_type": "x0"}, {"beta_schedule": "sigmoid"},
                {"timestep_spacing": "karras"}):
        with pytest.raises(ValueError):
            NoiseSchedule.from_scheduler_config(bad)


# --- API / validation ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd_schedule():
    return NoiseSchedule(**dict(SD, prediction_type="epsilon"))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_table_layout(sampler, sd_schedule):
    table = build_table(sampler, sd_schedule, 7)
    assert COLUMNS == ("t", "c_in", "p", "q", "a", "c", "d", "e", "r", "k")
    assert table.rows.dtype == np.float32 and table.rows.shape == (7, 10)
    assert table.rows64.dtype == np.float64 and table.rows64.shape == (7, 10)
    assert not table.column("k").any()  # clip_sample is off unless a config asks for it
    assert table.num_steps == 7 and table.sampler == sampler
    np.testing.assert_array_equal(table.timesteps, table.rows[:, 0])
    assert table.needs_noise == (sampler == "euler_a")
    assert np.any(table.column("e") != 0) == table.needs_noise
    assert np.any(table.column("d") != 0) == (sampler == "dpmpp_2m")
    assert not table.rows.flags.writeable
    assert np.all(np.diff(table.timesteps) < 0)


def test_bad_inputs_raise(sd_schedule):
    with pytest.raises(ValueError, match="sampler"):
        build_table("heun", sd_schedule, 10)
    for steps in (0, -1, 1001, 2.5, True):
        with pytest.raises(ValueError, match="num_steps"):
            build_table("ddim", sd_schedule, steps)
    with pytest.raises(ValueError, match="spacing"):
        build_table("euler", sd_schedule, 10, spacing="karras")
    with pytest.raises(ValueError, match="spacing"):
        NoiseSchedule(**dict(SD, prediction_type="epsilon", timestep_spacing="karras"))
    with pytest.raises(ValueError, match="beta_schedule"):
        NoiseSchedule(**dict(SD, prediction_type="epsilon", beta_schedule="cosine"))
    with pytest.raises(ValueError, match="prediction_type"):
        NoiseSchedule(**dict(SD, prediction_type="x0"))


def test_euler_a_needs_noise(sd_schedule):
    table = build_table("euler_a", sd_schedule, 4)
    x0 = np.zeros(SHAPE, np.float32)
    zero_model = lambda x, t: np.zeros_like(x)  # noqa: E731
    with pytest.raises(ValueError, match="needs noise"):
        sample(zero_model, x0, table)
    with pytest.raises(ValueError, match="needs noise"):
        iter_sample(zero_model, x0, table)  # eager, before the first next()
    with pytest.raises(ValueError, match="noise must have shape"):
        sample(zero_model, x0, table, noise=np.zeros((3, *SHAPE), np.float32))
    out = sample(zero_model, x0, table, noise=np.zeros((4, *SHAPE), np.float32))
    assert out.shape == SHAPE and out.dtype == np.float32
    sample(zero_model, x0, build_table("euler", sd_schedule, 4))  # deterministic: no noise needed


def test_model_output_shape_checked(sd_schedule):
    table = build_table("ddim", sd_schedule, 2)
    with pytest.raises(ValueError, match="model output shape"):
        sample(lambda x, t: np.zeros((2, *SHAPE[1:]), np.float32), np.zeros(SHAPE, np.float32), table)


def test_sample_matches_iter_sample_and_calls_back(sd_schedule):
    table = build_table("dpmpp_2m", sd_schedule, 5)
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal(SHAPE, dtype=np.float32)
    model = lambda x, t: np.tanh(x) * np.float32(t / 1000)  # noqa: E731
    steps = list(iter_sample(model, x0, table))
    calls = []
    final = sample(model, x0, table, callback=lambda i, x, d: calls.append(i))
    assert calls == list(range(5)) and [s[0] for s in steps] == calls
    np.testing.assert_array_equal(final, steps[-1][1])
    # The last step lands on sigma=0, so the final state is that step's x0 estimate.
    np.testing.assert_allclose(final, steps[-1][2], rtol=1e-6, atol=1e-6)


def test_cfg_helpers():
    rng = np.random.default_rng(6)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    u, c = rng.standard_normal((2, *SHAPE), dtype=np.float32)
    np.testing.assert_allclose(cfg_combine(u, c, 7.5), u + 7.5 * (c - u), rtol=1e-6)
    np.testing.assert_allclose(cfg_combine(u, c, 1.0), c, rtol=1e-6, atol=1e-6)
    assert cfg_batch(x).shape == (2, *SHAPE[1:])
    a, b = cfg_split(cfg_batch(x))
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, x)
    with pytest.raises(ValueError):
        cfg_split(np.zeros((3, 4)))

    def batched(x2, t):  # uncond half -> x, cond half -> 2x
        assert x2.shape[0] == 2 * x.shape[0]
        return np.concatenate([x2[:1], 2 * x2[1:]])

    np.testing.assert_allclose(guided(batched, 3.0)(x, 10.0), x + 3.0 * x, rtol=1e-6)


def test_library_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, onnxdiffusion.samplers, onnxdiffusion.samplers.schedules; "
            "bad = {'torch', 'diffusers'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
