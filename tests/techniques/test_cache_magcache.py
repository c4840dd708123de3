"""MagCache (cache=magcache:T[:K[:R]] or its dict): the spec and bad input, the ratio resampling and the
float32 decisions against diffusers' own code, parity with diffusers' MagCache hooks on tiny Flux, Qwen-Image
and SD3 pipelines given the same ratios (host loop and Loop graph), the same steps skipped by the host loop and
the Loop graph, calibration matching diffusers' calibration mode, and `cache calibrate` storing the ratios."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline, run_loop
from onnxdiffusion.techniques.cache_magcache import MagCache as MagCacheSpec, nearest_interp, retention_steps, skip_schedule
from onnxdiffusion.techniques import caching
from onnxdiffusion.techniques.caching import parse_cache, parse_compiled_cache

ROOT = Path(__file__).resolve().parents[2]
MMDIT = ROOT / "models" / "shapes-mmdit-onnx"
PROMPT = "a red circle on the left"
FLUX_RATIOS = [1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047,
               1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484,
               0.95703, 0.93359, 0.89062]  # diffusers' FLUX_MAG_RATIOS, as a user would paste them


# --- the spec ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("magcache:0.1", MagCacheSpec(0.1)), ("magcache:0.2:5", MagCacheSpec(0.2, 5)),
                                       ("magcache:0:2:0.5", MagCacheSpec(0.0, 2, 0.5)),
                                       (" magcache:0.06:3:0.2 ", MagCacheSpec())])
def test_spec_parses_and_reads_back(text, want):
    assert parse_cache(text) == want and parse_cache(str(want)) == want
    assert parse_compiled_cache("magcache") == MagCacheSpec(max_skip_steps=0)  # the structure: caches nothing


def test_dict_form_takes_diffusers_keys():
    got = parse_cache({"method": "magcache", "threshold": 0.1, "max_skip_steps": 2, "retention_ratio": 0.1,
                       "mag_ratios": FLUX_RATIOS})
    assert got == MagCacheSpec(0.1, 2, 0.1, tuple(FLUX_RATIOS)) and got.method == "magcache"
    assert parse_cache({"method": "magcache"}) == MagCacheSpec()
    assert parse_cache({"method": "magcache", "mag_ratios": np.array(FLUX_RATIOS)}).mag_ratios == tuple(FLUX_RATIOS)
    assert parse_cache("magcache:0.1:0").noop and not parse_cache("magcache:0").noop


@pytest.mark.parametrize("spec", ["magcache", "magcache:", "magcache:x", "magcache:-1", "magcache:nan",
                                  "magcache:0.1:-1", "magcache:0.1:1.5", "magcache:0.1:2:1.5", "magcache:0.1:2:0.2:9",
                                  {"method": "magcache", "threshold": -0.1}, {"method": "magcache", "mag_ratios": []},
                                  {"method": "magcache", "mag_ratios": [1.0, float("nan")]},
                                  {"method": "magcache", "mag_ratios": "1,2"}, {"method": "magcache", "calibrate": True},
                                  {"threshold": 0.1}])
def test_bad_spec_is_one_line_error(spec):
    with pytest.raises(UserError) as info:
        parse_cache(spec)
    assert "\n" not in str(info.value) and "magcache" in str(info.value)


# --- the arithmetic, against diffusers' own ---------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 12, 20, 28, 29, 50, 100])
def test_ratio_resampling_is_diffusers(n):
    import torch
    from diffusers.hooks.mag_cache import nearest_interp as theirs

    for src in (FLUX_RATIOS, FLUX_RATIOS[:5], [float(v) for v in np.linspace(0.8, 1.3, 41)]):
        want = theirs(torch.tensor(src), n).numpy()
        assert nearest_interp(src, n).tobytes() == want.tobytes()


def _diffusers_decisions(ratios, steps: int, threshold: float, max_skip: int, retention: float) -> list[bool]:
    """diffusers' MagCacheHeadHook decisions, driven step by step through its own hook (no model)."""
    import torch
    from diffusers.hooks.mag_cache import MagCacheConfig, MagCacheHeadHook, MagCacheState

    config = MagCacheConfig(threshold=threshold, max_skip_steps=max_skip, retention_ratio=retention,
                            num_inference_steps=steps, mag_ratios=list(ratios))
    state = MagCacheState()

    class Manager:
        _current_context = "inference"

        def get_state(self):
            return state

    class Meta:
        hidden_states_argument_name = "hidden_states"
        return_encoder_hidden_states_index = None

        @staticmethod
        def _get_parameter_from_args_kwargs(name, args, kwargs):
            return kwargs[name]

    hook = MagCacheHeadHook(Manager(), config)
    hook._metadata = Meta()
    hook.fn_ref = type("Ref", (), {"original_forward": staticmethod(lambda **kw: kw["hidden_states"])})()
    skipped = []
    for i in range(steps):
        state.step_index = i
        hook.new_forward(None, hidden_states=torch.zeros(1))
        skipped.append(not state.should_compute)
        if state.should_compute:
            state.previous_residual = torch.zeros(1)
    return skipped


@pytest.mark.parametrize("seed", range(6))
def test_decisions_are_diffusers_float32_ones(seed):
    """Random ratios near 1 and thresholds on the float32 grid's edge: the same steps skipped as diffusers."""
    rng = np.random.default_rng(seed)
    ratios = (1.0 + rng.normal(0, 0.03, int(rng.integers(5, 40)))).tolist()
    for steps in (4, 10, 20, 33):
        for threshold in (0.0, 0.01, 0.03, 0.06, 0.1, 0.3):
            for max_skip, retention in ((3, 0.2), (1, 0.0), (6, 0.5)):
                mine = skip_schedule(nearest_interp(ratios, steps), threshold, max_skip, retention_steps(retention, steps))
                assert mine == _diffusers_decisions(ratios, steps, threshold, max_skip, retention), (steps, threshold)


# --- parity with diffusers' MagCache hooks ---------------------------------------------------------

H = W = 32
STEPS = 12

FAMILIES = {  # fixture stem: (diffusers pipeline call extras, our guidance)
    "flux": (dict(guidance_scale=3.5, max_sequence_length=16), 3.5),
    "qwenimage": (dict(negative_prompt="blurry", true_cfg_scale=4.0), 4.0),
}


def _spy(monkeypatch) -> list:
    made, real = [], caching.cached_backbone

    def spy(*a):
        made.append(real(*a))
        return made[-1]

    monkeypatch.setattr(caching, "cached_backbone", spy)
    return made


def _reference(src, latents, config, family: str, steps: int = STEPS):
    """diffusers' pipeline with MagCache on its transformer: (final latents, per transformer call: computed?)."""
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.hooks.mag_cache import apply_mag_cache

    ref = DiffusionPipeline.from_pretrained(src, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    calls = []
    if config is not None:
        apply_mag_cache(ref.transformer, config)
        head = ref.transformer.transformer_blocks[0]
        ref.transformer.register_forward_pre_hook(lambda m, a: calls.append(False))
        for sub in head.modules():
            if sub is not head:
                sub.register_forward_pre_hook(lambda m, a: calls.__setitem__(-1, True))
    extra, _ = FAMILIES[family]
    out = ref(PROMPT, height=H, width=W, num_inference_steps=steps, latents=torch.from_numpy(latents),
              output_type="latent", **extra)
    return out.images.numpy(), calls


def _db(got: np.ndarray, want: np.ndarray) -> float:
    """PSNR of final latents over their span (the tiny random VAEs decode most latents to the same image)."""
    return psnr(np.asarray(got, np.float32), np.asarray(want, np.float32), data_range=float(want.max() - want.min()))


def _config(spec: MagCacheSpec, steps: int = STEPS):
    from diffusers.hooks.mag_cache import MagCacheConfig

    return MagCacheConfig(threshold=spec.threshold, max_skip_steps=spec.max_skip_steps,
                          retention_ratio=spec.retention_ratio, num_inference_steps=steps, mag_ratios=list(spec.mag_ratios))


def _ours(pipe, family, latents, cache, loop="host"):
    extra, guidance = FAMILIES[family]
    return pipe(PROMPT, negative_prompt=extra.get("negative_prompt"), steps=STEPS, sampler="flow_euler",
                guidance=guidance, height=H, width=W, latents=latents, cache=cache, loop=loop)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The family's folder with its Loop graph compiled with --cache magcache (made once per family)."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    made = {}

    def get(src: Path) -> Path:
        if src not in made:
            made[src] = tmp_path_factory.mktemp("magcache_loop") / "model"
            compile_loop(src, made[src], cache="magcache")
        return made[src]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("setting", [dict(threshold=0.06), dict(threshold=0.2, max_skip_steps=2, retention_ratio=0.1)])
def test_matches_diffusers_mag_cache_host_and_loop(family, setting, request, monkeypatch, compiled):
    src = request.getfixturevalue(f"tiny_{family}_diffusers")
    pipe = Pipeline.from_folder(compiled(request.getfixturevalue(f"tiny_{family}_onnx")), verify=False)
    cache = {"method": "magcache", "mag_ratios": FLUX_RATIOS, **setting}
    spec = parse_cache(cache)
    latents = np.random.default_rng(4).standard_normal(pipe.latent_shape_for(1, H, W), dtype=np.float32)
    made = _spy(monkeypatch)
    base = _ours(pipe, family, latents, None)
    host = _ours(pipe, family, latents, cache)
    loop = _ours(pipe, family, latents, cache, loop="loop")
    ref_base, _ = _reference(src, latents, None, family)
    ref, calls = _reference(src, latents, _config(spec), family)
    per_step = len(calls) // STEPS  # Qwen-Image's true CFG: cond and uncond calls, each with its own state
    ref_full = [i for i in range(STEPS) if calls[i * per_step]]
    full = made[-1].full_steps
    moved, db_host, db_loop = _db(ref, ref_base), _db(host.latents, ref), _db(loop.latents, ref)
    print(f"\n{family} {spec}: diffusers computed {ref_full}, ours {full}; diffusers cached vs uncached {moved:.1f} dB;"
          f" ours vs diffusers: host {db_host:.1f} dB, Loop {db_loop:.1f} dB; uncached {_db(base.latents, ref_base):.1f} dB")
    assert full == ref_full and len(full) < STEPS
    assert all(calls[i * per_step:(i + 1) * per_step] == [calls[i * per_step]] * per_step for i in range(STEPS))
    assert moved < db_host - 10.0  # the cache moved diffusers' latents far more than ours are from them
    assert db_host >= 40.0 and db_loop >= 40.0


@pytest.mark.slow
def test_matches_diffusers_mag_cache_on_sd3(tiny_sd3_diffusers, tiny_sd3_onnx, monkeypatch):
    """SD3's joint blocks take diffusers' hooks too (its batched CFG: one state for both halves, as ours)."""
    import torch
    from diffusers import StableDiffusion3Pipeline
    from diffusers.hooks.mag_cache import apply_mag_cache

    spec = parse_cache({"method": "magcache", "threshold": 0.1, "mag_ratios": FLUX_RATIOS})
    pipe = Pipeline.from_folder(tiny_sd3_onnx, verify=False)
    made = _spy(monkeypatch)
    ours = pipe(PROMPT, steps=STEPS, sampler="flow_euler", guidance=5.0, seed=3, cache=spec)
    ref = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_diffusers, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    kw = dict(latents=torch.from_numpy(ours.init_latents), height=32, width=32, num_inference_steps=STEPS,
              guidance_scale=5.0, output_type="latent")
    plain = ref(PROMPT, **kw).images.numpy()
    apply_mag_cache(ref.transformer, _config(spec))
    want = ref(PROMPT, **kw).images.numpy()
    moved, db = _db(want, plain), _db(ours.latents, want)
    print(f"\nsd3 {spec}: ours computed {made[-1].full_steps}; diffusers cached vs uncached {moved:.1f} dB; "
          f"ours vs diffusers {db:.1f} dB")
    assert len(made[-1].full_steps) < STEPS and moved < db - 10.0 and db >= 40.0


# --- calibration ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_calibration_matches_diffusers_calibrate_mode(tiny_flux_diffusers, tiny_flux_onnx):
    import torch
    from diffusers import FluxPipeline
    from diffusers.hooks.mag_cache import MagCacheConfig, apply_mag_cache

    pipe = Pipeline.from_folder(tiny_flux_onnx, verify=False)
    latents = np.random.default_rng(7).standard_normal(pipe.latent_shape_for(1, H, W), dtype=np.float32)
    got: list[float] = []
    pipe(PROMPT, steps=STEPS, sampler="flow_euler", guidance=3.5, height=H, width=W, latents=latents,
         cache=MagCacheSpec(calibrate=True, recorder=got))
    ref = FluxPipeline.from_pretrained(tiny_flux_diffusers, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    apply_mag_cache(ref.transformer, MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ref(PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=3.5, max_sequence_length=16,
            latents=torch.from_numpy(latents), output_type="np")
    want = json.loads(re.search(r"(\[[^\]]*\])", printed.getvalue().split("Calibration Complete")[1]).group(1))
    print(f"\nours {np.round(got, 4).tolist()}\ndiffusers {np.round(want, 4).tolist()}")
    assert len(got) == len(want) == STEPS and got[0] == 1.0
    np.testing.assert_allclose(got, want, rtol=2e-3)
    assert max(abs(v - 1.0) for v in got) > 0.01  # a real signal, not all ones


@pytest.mark.slow
def test_calibrate_verb_stores_ratios_the_generate_reads(tmp_path):
    from cli_helpers import invoke

    folder = tmp_path / "model"
    shutil.copytree(MMDIT, folder)
    with pytest.raises(UserError, match="cache calibrate") as info:
        Pipeline.from_folder(folder)(PROMPT, steps=4, cache="magcache:0.1")
    assert "\n" not in str(info.value)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square above a green star\n")
    before = json.loads((folder / "manifest.json").read_text())
    result = invoke("cache", "calibrate", folder, "--prompts", prompts, "--steps", 8, "--threads", 1, timeout=300)
    assert result.returncode == 0, result.stderr
    after = json.loads((folder / "manifest.json").read_text())
    record = after.pop("magcache")
    assert after == before  # nothing else rewritten
    assert record["steps"] == 8 and len(record["ratios"]) == 8 and record["prompts"] == 2 and record["ratios"][0] == 1.0
    assert not [p for p in folder.iterdir() if p.name.startswith(".manifest")]  # no temporary left
    pipe = Pipeline.from_folder(folder)  # still verifies: the hashed files are untouched
    plain = pipe(PROMPT, steps=12, seed=1)
    cached = pipe(PROMPT, steps=12, seed=1, cache="magcache:0.3")  # 8 calibrated steps resampled to 12
    assert psnr(cached.images, plain.images) < 60.0
    bad = invoke("cache", "calibrate", folder, "--prompts", tmp_path / "none.txt")
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(errors) == 1 and "cannot read prompts file" in errors[0]


# --- the Loop graph decides as the host loop does (embedded MMDiT) ----------------------------------

@pytest.mark.slow
def test_loop_graph_skips_the_host_loops_steps(tmp_path, monkeypatch):
    """Random ratios, thresholds and retentions: cache_computed of the Loop graph is the host loop's schedule,
    and the latents are the host loop's; the defaults of its inputs skip nothing (the plain Loop bit for bit)."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    plain_folder, folder = tmp_path / "plain", tmp_path / "mag"
    compile_loop(MMDIT, plain_folder)
    compile_loop(MMDIT, folder, cache="magcache")
    pipe = Pipeline.from_folder(folder)
    graph = pipe.sampling_graph("loop")
    runs, real = [], graph.session

    class Spy:
        def run(self, names, feeds):
            outs = real.run(None, feeds)
            runs.append([int(k) for k in np.flatnonzero(outs[-1])])
            return outs

    graph.session = Spy()
    made = _spy(monkeypatch)
    rng = np.random.default_rng(0)
    for k, (threshold, max_skip, retention) in enumerate([(0.06, 3, 0.2), (0.15, 2, 0.0), (0.4, 6, 0.3)]):
        ratios = (1.0 + rng.normal(0, 0.05, 28)).tolist()
        cache = {"method": "magcache", "threshold": threshold, "max_skip_steps": max_skip,
                 "retention_ratio": retention, "mag_ratios": ratios}
        host = pipe(PROMPT, steps=15, seed=k, cache=cache)
        loop = pipe(PROMPT, steps=15, seed=k, cache=cache, loop="loop")
        want = [i for i, s in enumerate(skip_schedule(nearest_interp(ratios, 15), threshold, max_skip,
                                                      retention_steps(retention, 15))) if not s]
        assert made[-1].full_steps == runs[-1] == want and len(want) < 15
        assert psnr(loop.latents, host.latents, data_range=float(np.abs(host.latents).max())) >= 60.0
    want = Pipeline.from_folder(plain_folder)(PROMPT, steps=8, seed=1, loop="loop")
    for spec in (None, "magcache:0.3:0"):
        got = pipe(PROMPT, steps=8, seed=1, loop="loop", cache=spec)
        assert np.array_equal(got.latents, want.latents)
    with pytest.raises(UserError, match="compile-loop --cache") as info:
        Pipeline.from_folder(plain_folder)(PROMPT, steps=3, cache="magcache:0.1", loop="loop")
    assert "\n" not in str(info.value)


def test_refused_on_a_unet(tiny_onnx):
    with pytest.raises(UserError, match="deepcache") as info:
        Pipeline.from_folder(tiny_onnx, verify=False)(PROMPT, steps=3, cache={"method": "magcache", "mag_ratios": [1.0]})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec,fragment", [("magcache:x", "magcache:THRESHOLD"), ("magcache:0.1:2:7", "RETENTION"),
                                           ("magcache:0.1", "cache calibrate")])
def test_generate_refuses_in_one_line(tmp_path, spec, fragment):
    """A bad spec before any model loads; a folder without ratios before any model runs."""
    from cli_helpers import assert_one_line_error, invoke

    proc = invoke("generate", "a red circle", "--model", MMDIT, "--steps", 4, "--cache", spec, "-o", tmp_path / "x.png")
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "x.png").exists()
