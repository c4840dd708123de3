"""Acceptance: every option of diffusers' DDIM, Euler, Euler ancestral, DPM-Solver multistep and
flow-match Euler/Heun scheduler configs either reproduces diffusers' ``scheduler.step`` trajectory
(max relative error 1e-5, float64 tables, same fake model) or is refused by a one-line error
naming the option."""

import inspect
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("scipy")  # diffusers' beta sigmas need it

from sampler_oracle import SHAPE, diffusers_trajectory, table_trajectory, within  # noqa: E402

from onnxdiffusion.samplers import resolve, table_from_config  # noqa: E402
from onnxdiffusion.samplers.config import CLASS_DEFAULTS, DEFAULT_SAMPLER  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

RTOL = 1e-5
SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
COSINE = dict(beta_schedule="squaredcos_cap_v2")
LINEAR = dict(beta_start=0.0001, beta_end=0.02, beta_schedule="linear")
TRAINED = dict(trained_betas=np.linspace(0.00085**0.5, 0.012**0.5, 1000).__pow__(2).tolist())
ZERO_SNR = dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction", timestep_spacing="trailing")


def _cases():
    """(class, config, steps, set_timesteps kwargs); option values vary one or two at a time."""
    out = []

    def add(cls, cfgs, steps=(1, 3, 10, 25), **kw):
        for cfg in cfgs:
            for n in steps:
                out.append((cls, cfg, n, kw))

    spacings = ("leading", "trailing", "linspace")
    preds = ("epsilon", "v_prediction", "sample")
    ddim = dict(SD, clip_sample=False, set_alpha_to_one=False)
    add("DDIMScheduler", [dict(ddim, prediction_type=p, timestep_spacing=s) for p in preds for s in spacings])
    add("DDIMScheduler", [dict(ddim, clip_sample=True), dict(ddim, clip_sample=True, clip_sample_range=0.3),
                          dict(ddim, clip_sample=True, prediction_type="v_prediction", timestep_spacing="trailing"),
                          dict(ddim, set_alpha_to_one=True), dict(ddim, steps_offset=0), {},  # class defaults
                          dict(ZERO_SNR, clip_sample=False), dict(ddim, **LINEAR), dict(ddim, **COSINE),
                          dict(ddim, **TRAINED), dict(ddim, num_train_timesteps=500)])
    add("EulerDiscreteScheduler", [dict(SD, prediction_type=p, timestep_spacing=s) for p in preds for s in spacings])
    add("EulerDiscreteScheduler", [
        dict(SD, use_karras_sigmas=True), dict(SD, use_exponential_sigmas=True), dict(SD, use_beta_sigmas=True),
        dict(SD, use_karras_sigmas=True, timestep_spacing="leading"),
        dict(SD, use_karras_sigmas=True, sigma_min=0.1, sigma_max=10.0),
        dict(SD, use_exponential_sigmas=True, sigma_min=0.05, sigma_max=12.0),
        dict(SD, interpolation_type="log_linear"), dict(SD, final_sigmas_type="sigma_min"),
        dict(SD, final_sigmas_type="sigma_min", use_karras_sigmas=True),
        dict(SD, timestep_type="continuous", prediction_type="v_prediction", use_karras_sigmas=True),
        dict(ZERO_SNR), dict(SD, steps_offset=0, timestep_spacing="leading"), dict(SD, **TRAINED), {},
        dict(SD, num_train_timesteps=500), dict(LINEAR), dict(COSINE, prediction_type="v_prediction")])
    add("EulerAncestralDiscreteScheduler", [dict(SD, prediction_type=p, timestep_spacing=s)
                                            for p in preds[:2] for s in spacings]
        + [dict(ZERO_SNR), {}, dict(SD, num_train_timesteps=500), dict(SD, **TRAINED), dict(LINEAR)])
    dpm = dict(SD, algorithm_type="dpmsolver++", solver_order=2)
    add("DPMSolverMultistepScheduler", [dict(dpm, prediction_type=p, timestep_spacing=s)
                                        for p in preds + ("flow_prediction",) for s in spacings])
    add("DPMSolverMultistepScheduler", [
        dict(dpm, solver_order=1), dict(dpm, solver_type="heun"), dict(dpm, algorithm_type="sde-dpmsolver++"),
        dict(dpm, algorithm_type="sde-dpmsolver++", solver_type="heun"), dict(dpm, lower_order_final=False),
        dict(dpm, euler_at_final=True), dict(dpm, final_sigmas_type="sigma_min"),
        dict(dpm, final_sigmas_type="sigma_min", lower_order_final=False),
        dict(dpm, use_exponential_sigmas=True, final_sigmas_type="sigma_min", lower_order_final=False),
        # (the same with solver_type="heun" gives NaN in diffusers: (exp(-h) - 1) / h at h = 0; ours steps x' = x)
        dict(dpm, use_karras_sigmas=True), dict(dpm, use_exponential_sigmas=True), dict(dpm, use_beta_sigmas=True),
        dict(dpm, use_lu_lambdas=True), dict(dpm, use_lu_lambdas=True, **COSINE),
        dict(dpm, lambda_min_clipped=-5.1, **COSINE), dict(dpm, **ZERO_SNR), dict(dpm, **TRAINED), {},
        dict(dpm, num_train_timesteps=500), dict(dpm, **LINEAR),
        dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0),
        dict(use_flow_sigmas=True, prediction_type="flow_prediction", solver_type="heun", lower_order_final=False),
        dict(use_flow_sigmas=True, prediction_type="flow_prediction", algorithm_type="sde-dpmsolver++")],
        steps=(1, 3, 10, 20))
    add("DPMSolverMultistepScheduler", [dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                                             use_dynamic_shifting=True)], mu=0.9)
    add("FlowMatchEulerDiscreteScheduler", [
        {}, dict(shift=3.0), dict(shift=3.0, shift_terminal=0.05), dict(shift=3.0, use_karras_sigmas=True),
        dict(shift=3.0, use_exponential_sigmas=True), dict(shift=3.0, use_beta_sigmas=True),
        dict(shift=3.0, stochastic_sampling=True), dict(shift=2.0, num_train_timesteps=500)], steps=(2, 4, 10, 28))
    add("FlowMatchEulerDiscreteScheduler", [
        dict(use_dynamic_shifting=True), dict(use_dynamic_shifting=True, time_shift_type="linear"),
        dict(use_dynamic_shifting=True, shift_terminal=0.02)], steps=(2, 4, 28), mu=1.1)
    add("FlowMatchHeunDiscreteScheduler", [{}, dict(shift=3.0), dict(shift=3.0, num_train_timesteps=500)],
        steps=(1, 2, 5, 20))
    # the two schedulers real SD folders ship most, then the few-step distilled ones
    pndm = dict(SD, skip_prk_steps=True)
    add("PNDMScheduler", [dict(pndm, prediction_type=p, timestep_spacing=s) for p in preds[:2] for s in spacings]
        + [dict(pndm, set_alpha_to_one=True), dict(pndm, steps_offset=0), dict(pndm, **TRAINED),
           dict(pndm, num_train_timesteps=500), dict(pndm, **LINEAR), dict(pndm, **COSINE)], steps=(1, 2, 3, 4, 10, 25))
    add("UniPCMultistepScheduler", [dict(SD, prediction_type=p, timestep_spacing=s) for p in preds for s in spacings])
    add("UniPCMultistepScheduler", [
        {}, dict(SD, solver_order=1), dict(SD, solver_order=3),
        dict(SD, lower_order_final=False, final_sigmas_type="sigma_min"),
        dict(SD, solver_type="bh1", final_sigmas_type="sigma_min"), dict(SD, final_sigmas_type="sigma_min"),
        dict(SD, solver_order=3, lower_order_final=False, final_sigmas_type="sigma_min"),
        dict(SD, disable_corrector=[0, 2]),
        dict(SD, use_karras_sigmas=True), dict(SD, use_exponential_sigmas=True), dict(SD, use_beta_sigmas=True),
        dict(SD, **ZERO_SNR), dict(SD, **TRAINED), dict(SD, num_train_timesteps=500), dict(LINEAR), dict(COSINE)],
        steps=(1, 2, 3, 10, 25))
    for cls in ("LCMScheduler", "TCDScheduler"):
        add(cls, [{}, dict(prediction_type="v_prediction"), dict(prediction_type="sample"), dict(original_inference_steps=20),
                  dict(timestep_scaling=4.0), dict(set_alpha_to_one=False), dict(clip_sample=True, clip_sample_range=0.5),
                  dict(LINEAR), dict(TRAINED), dict(steps_offset=1, timestep_spacing="trailing"),
                  dict(rescale_betas_zero_snr=True, prediction_type="v_prediction"), dict(num_train_timesteps=500)],
            steps=(1, 2, 4, 8))
    # SD-Turbo / SDXL-Turbo ship Euler ancestral on trailing spacing; Flux-schnell few-step flow Euler
    add("EulerAncestralDiscreteScheduler", [dict(SD, timestep_spacing="trailing")], steps=(1, 2, 4))
    add("FlowMatchEulerDiscreteScheduler", [dict(shift=1.0), dict(use_dynamic_shifting=True)], steps=(1, 2, 4), mu=1.15)
    return out


REFUSALS = [
    ("DDIMScheduler", dict(thresholding=True), "thresholding"),
    ("DPMSolverMultistepScheduler", dict(thresholding=True), "thresholding"),
    ("DPMSolverMultistepScheduler", dict(variance_type="learned_range"), "variance_type"),
    ("DPMSolverMultistepScheduler", dict(variance_type="learned"), "variance_type"),
    ("DPMSolverMultistepScheduler", dict(solver_order=3), "solver_order"),
    ("DPMSolverMultistepScheduler", dict(algorithm_type="dpmsolver", final_sigmas_type="sigma_min"), "algorithm_type"),
    ("DPMSolverMultistepScheduler", dict(algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min"),
     "algorithm_type"),
    ("DPMSolverMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                                         use_karras_sigmas=True), "use_flow_sigmas"),
    ("DPMSolverMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="epsilon"), "prediction_type"),
    ("DPMSolverMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                                         final_sigmas_type="sigma_min"), "final_sigmas_type"),
    ("DPMSolverMultistepScheduler", dict(use_dynamic_shifting=True), "use_dynamic_shifting"),
    ("DPMSolverMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                                         use_dynamic_shifting=True, time_shift_type="linear"), "time_shift_type"),
    ("DPMSolverMultistepScheduler", dict(use_karras_sigmas=True, use_lu_lambdas=True), "use_lu_lambdas"),
    ("EulerDiscreteScheduler", dict(prediction_type="flow_prediction"), "prediction_type"),
    ("EulerAncestralDiscreteScheduler", dict(prediction_type="sample"), "prediction_type"),
    ("FlowMatchEulerDiscreteScheduler", dict(invert_sigmas=True), "invert_sigmas"),
    ("PNDMScheduler", dict(skip_prk_steps=False), "skip_prk_steps"),
    ("UniPCMultistepScheduler", dict(thresholding=True), "thresholding"),
    ("UniPCMultistepScheduler", dict(predict_x0=False), "predict_x0"),
    ("UniPCMultistepScheduler", dict(solver_type="bh1"), "solver_type"),  # diffusers' last step is NaN
    ("UniPCMultistepScheduler", dict(lower_order_final=False), "lower_order_final"),  # ... and inf here
    ("UniPCMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="flow_prediction"), "use_flow_sigmas"),
    ("UniPCMultistepScheduler", dict(use_dynamic_shifting=True), "use_dynamic_shifting"),
    ("UniPCMultistepScheduler", dict(use_karras_sigmas=True, final_sigmas_type="sigma_min"), "final_sigmas_type"),
    ("UniPCMultistepScheduler", dict(sigma_min=0.1), "sigma_min"),
    ("UniPCMultistepScheduler", dict(sigma_max=10.0), "sigma_max"),
    ("UniPCMultistepScheduler", dict(shift_terminal=0.1, use_flow_sigmas=True, prediction_type="flow_prediction"),
     "use_flow_sigmas"),
    ("LCMScheduler", dict(thresholding=True), "thresholding"),
]
# options that change nothing unless another option is on (thresholding), or that only feed mu
INERT = {"dynamic_thresholding_ratio", "sample_max_value", "base_shift", "max_shift", "base_image_seq_len",
         "max_image_seq_len",
         "flow_shift", "time_shift_type", "shift_terminal",  # UniPC: only with the refused use_flow_sigmas
         "solver_p",  # a scheduler object, never in a saved config (refused when set)
         "thresholding"}  # TCDScheduler.step never reads it (LCM's is refused above)
RESULTS = {"matched": [], "refused": []}


def _make(cls, cfg):
    return getattr(diffusers, cls)(**cfg)


@pytest.mark.parametrize("cls,cfg,n,kw", _cases(), ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={v[k]}" for k in v if k != "trained_betas")[:80] or "defaults")
def test_config_matches_diffusers(cls, cfg, n, kw):
    ref = _make(cls, cfg)
    config = {"_class_name": cls, **ref.config}
    table = table_from_config(config, n, **kw)
    assert table.sampler == DEFAULT_SAMPLER[cls]
    rng = np.random.default_rng(n)
    x0 = rng.standard_normal(SHAPE)
    noise = rng.standard_normal((table.num_steps, *SHAPE))
    ts, states = diffusers_trajectory(ref, x0, n, noise, **kw)
    np.testing.assert_allclose(table.rows64[:, 0], ts, rtol=1e-6, atol=1e-4)
    assert table.init_scale == pytest.approx(float(getattr(ref, "init_noise_sigma", 1.0)), rel=1e-6)
    err, ok, strict = within(table_trajectory(table, x0, noise), states, x0 * table.init_scale, RTOL)
    RESULTS["matched"].append((cls, err, strict))
    assert ok, f"max relative error {err:.2e}"


@pytest.mark.parametrize("cls,cfg,option", REFUSALS, ids=lambda v: v if isinstance(v, str) else None)
def test_unreproduced_option_is_refused_by_name(cls, cfg, option):
    config = {"_class_name": cls, **_make(cls, cfg).config}  # diffusers itself accepts the config
    with pytest.raises(ValueError, match=option) as info:
        table_from_config(config, 10, mu=1.0)
    msg = str(info.value)
    assert "\n" not in msg and repr(config[option]) in msg
    RESULTS["refused"].append((cls, option, config[option]))


@pytest.mark.parametrize("cls", list(CLASS_DEFAULTS))
def test_every_option_is_known_with_diffusers_defaults(cls):
    params = {k: p.default for k, p in inspect.signature(getattr(diffusers, cls).__init__).parameters.items()
              if k != "self"}
    assert set(params) == set(CLASS_DEFAULTS[cls])
    for k, v in params.items():
        ours = CLASS_DEFAULTS[cls][k]
        assert ours == v or (isinstance(v, float) and math.isinf(v) and ours == v), (k, ours, v)


def test_every_option_is_exercised():
    """Each option of each class is varied in a matched case or refused (or only matters with a refused one)."""
    varied = {cls: set() for cls in CLASS_DEFAULTS}
    for cls, cfg, _, _ in _cases():
        varied[cls] |= set(cfg)
    for cls, cfg, option in REFUSALS:
        varied[cls] |= {option}
    for cls, keys in CLASS_DEFAULTS.items():
        missing = set(keys) - varied[cls] - INERT
        assert not missing, (cls, missing)


def test_sampler_override_follows_from_config():
    """--sampler X on a folder runs X's class as from_config(folder config) would."""
    ddim = dict(DDIMScheduler_config := {"_class_name": "DDIMScheduler", **SD, "clip_sample": True})
    sampler, sched, opts = resolve(ddim, "euler")
    assert sampler == "euler" and opts.clip_sample_range is None and sched.timestep_spacing == "linspace"
    assert resolve(DDIMScheduler_config)[2].clip_sample_range == 1.0
    flux = {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True, "shift": 3.0}
    with pytest.raises(ValueError, match="does not apply"):
        table_from_config(flux, 4, "euler_a", mu=1.0)
    with pytest.raises(ValueError, match="does not apply"):
        table_from_config(ddim, 4, "flow_euler")
    t = table_from_config(flux, 4, "dpmpp_2m", image_seq_len=1024)
    assert t.rows64[0, 0] == pytest.approx(1000.0) and t.init_scale == 1.0
    assert table_from_config(flux, 4, "flow_heun", mu=1.0).num_steps == 7
    assert table_from_config({"_class_name": "PNDMScheduler", **SD, "skip_prk_steps": True}, 4).sampler == "pndm"


def test_zz_summary():
    matched, refused = RESULTS["matched"], RESULTS["refused"]
    if not matched:
        pytest.skip("run with the whole module")
    by_cls = {}
    for cls, err, strict in matched:
        n, worst, loose = by_cls.get(cls, (0, 0.0, 0))
        by_cls[cls] = (n + 1, max(worst, err), loose + (not strict))
    loose = [e for _, e, strict in matched if not strict]
    print(f"\nacceptance 2: {len(matched)} configurations matched diffusers' scheduler.step; "
          f"{len(matched) - len(loose)} within {RTOL:g} (max rel error "
          f"{max([e for _, e, s in matched if s] or [0]):.2e}), {len(loose)} within {RTOL:g} + diffusers' own "
          f"float32 roundoff (max {max(loose or [0]):.2e}); {len(refused)} refused by name")
    for cls, (n, worst, nloose) in by_cls.items():
        print(f"  {cls}: {n} matched, max rel error {worst:.2e}, {nloose} needed the float32 allowance")
    for cls, option, value in refused:
        print(f"  refused {cls}: {option}={value!r}")
