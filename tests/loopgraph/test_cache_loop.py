"""Step caching in the Loop graph (techniques/caching_graph.py) against its twin, the host loop's
(techniques/caching.py), on both embedded models: the same steps computed, the same latents; the defaults
(interval 1, threshold 0, no --cache) give the plain Loop graph's image bit for bit; refusals in one line."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.techniques import caching
from onnxdiffusion.samplers.cache_math import fold_sum, relative_change
from onnxdiffusion.loopgraph.builder import _Builder
from onnxdiffusion.techniques.graph_fold import fold_sum as fold_sum_graph

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SD, MMDIT = ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"
PROMPT = "a red circle above a blue square"
# (model, what compile-loop --cache gets, specs generate runs on that graph)
CASES = [(SD, "deepcache", ["deepcache:2", "deepcache:3"]), (SD, "deepcache:2:2", ["deepcache:2:2"]),
         (SD, "deepcache:3:L1", ["deepcache:3:L1", "deepcache:4:L1"]),
         (MMDIT, "first_block", ["first_block:0.25", "first_block:0.5"]),
         (MMDIT, "taylorseer", ["taylorseer:2", "taylorseer:3"]), (MMDIT, "taylorseer:2:2", ["taylorseer:2:2"]),
         (MMDIT, "residual", ["residual:3", "residual:5"]), (MMDIT, "residual:4:2", ["residual:4:2"])]


def _fold_session():
    b = _Builder()
    b.const("axes0", np.array([0], np.int64))
    for name, v in (("one", 1), ("two", 2)):
        b.const(f"cache_{name}_i64", np.array(v, np.int64))
    b.const("cache_flat", np.array([-1], np.int64))
    b.const("cache_scalar", np.zeros((0,), np.int64))
    b.const("cache_head", np.array([0], np.int64))
    r = b.op("Abs", [b.op("Sub", ["r", "prev"], "dr")], "abs_dr")
    ratio = b.op("Div", [fold_sum_graph(b, r, "fa"), fold_sum_graph(b, b.op("Abs", ["prev"], "ap"), "fb")], "ratio")
    b.op("Identity", [fold_sum_graph(b, "r", "fr")], "total")
    f = TensorProto.FLOAT
    graph = helper.make_graph(b.nodes, "fold", [helper.make_tensor_value_info(n, f, ["n"]) for n in ("r", "prev")],
                              [helper.make_tensor_value_info("total", f, []), helper.make_tensor_value_info(ratio, f, [])],
                              initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 4097, 2 * 16 * 16 * 64])
def test_fold_sum_graph_is_its_numpy_twin(size):
    """Bit for bit, on values spread over many binades (where summation order shows)."""
    rng = np.random.default_rng(size)
    r = (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 5, size)).astype(np.float32)
    prev = (r + rng.standard_normal(size).astype(np.float32) * 0.1).astype(np.float32)
    total, ratio = _fold_session().run(None, {"r": r, "prev": prev})
    assert total.tobytes() == np.float32(fold_sum(r)).tobytes()
    assert ratio.tobytes() == np.float32(relative_change(r, prev)).tobytes()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_loop")
    made = {}

    def get(model: Path, cache: str | None) -> Path:
        key = (model.name, cache)
        if key not in made:
            made[key] = root / f"{model.name}-{cache or 'plain'}".replace(":", "_")
            compile_loop(model, made[key], cache=cache)
        return made[key]

    return get


def _host_full_steps(monkeypatch) -> list:
    """The host loop's CachedBackbones of the next generations, to read which steps ran the span."""
    made = []
    real = caching.cached_backbone

    def spy(*a):
        made.append(real(*a))
        return made[-1]

    monkeypatch.setattr(caching, "cached_backbone", spy)
    return made


def _loop_full_steps(pipe) -> list:
    """Wrap the Loop graph's session to keep its cache_computed output of each run."""
    graph = pipe.sampling_graph("loop")
    runs, real = [], graph.session

    class Spy:
        def run(self, names, feeds):
            outs = real.run(None, feeds)
            runs.append([int(k) for k in np.flatnonzero(outs[graph.output_names.index("cache_computed")])])
            return outs

    graph.session = Spy()
    return runs


@pytest.mark.parametrize("model,compiled_with,specs", CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_loop_cache_matches_the_host_loop(compiled, monkeypatch, model, compiled_with, specs):
    pipe = Pipeline.from_folder(compiled(model, compiled_with))
    host_made, loop_runs = _host_full_steps(monkeypatch), _loop_full_steps(pipe)
    plain = pipe(PROMPT, steps=12, seed=4, loop="loop")
    for spec in specs:
        host = pipe(PROMPT, steps=12, seed=4, cache=spec)
        loop = pipe(PROMPT, steps=12, seed=4, cache=spec, loop="loop")
        full = host_made[-1].full_steps
        db = psnr(loop.latents, host.latents, data_range=float(np.abs(host.latents).max()))
        print(f"\n{model.name} {spec}: host computed {full}; Loop vs host latents {db:.1f} dB, "
              f"{'identical' if np.array_equal(loop.latents, host.latents) else 'not identical'}")
        assert loop_runs[-1] == full and len(full) < 12  # the same steps skipped, and some were
        assert db >= 60.0
        assert psnr(loop.images, plain.images) < 60.0  # the cache moved the image


@pytest.mark.parametrize("model,compiled_with,noop", [(SD, "deepcache", "deepcache:1"),
                                                      (SD, "deepcache:3:L1", "deepcache:1:L1"),
                                                      (MMDIT, "first_block", "first_block:0"),
                                                      (MMDIT, "taylorseer", "taylorseer:1"),
                                                      (MMDIT, "residual", "residual:1")])
def test_nothing_cached_is_the_plain_loop_bit_for_bit(compiled, model, compiled_with, noop):
    plain = Pipeline.from_folder(compiled(model, None))
    cached = Pipeline.from_folder(compiled(model, compiled_with))
    kw = dict(steps=8, seed=1, loop="loop")
    want = plain(PROMPT, **kw)
    for spec in (None, noop):
        got = cached(PROMPT, cache=spec, **kw)
        assert np.array_equal(got.latents, want.latents) and np.array_equal(got.images, want.images)
    assert np.array_equal(plain(PROMPT, cache=noop, **kw).images, want.images)  # a no-op spec on a plain graph


def test_specs_the_graph_was_not_compiled_for_are_refused(compiled):
    plain = Pipeline.from_folder(compiled(SD, None))
    deep = Pipeline.from_folder(compiled(SD, "deepcache"))
    layer = Pipeline.from_folder(compiled(SD, "deepcache:3:L1"))
    taylor = Pipeline.from_folder(compiled(MMDIT, "taylorseer"))
    for pipe, spec, fragment in ((plain, "deepcache:2", "without step caching"), (deep, "deepcache:2:2", "BRANCH 1"),
                                 (deep, "deepcache:3:L1", "BRANCH 1"), (layer, "deepcache:3", "BRANCH L1"),
                                 (taylor, "taylorseer:2:2", "ORDER 1"), (taylor, "first_block:0.1", "taylorseer"),
                                 (taylor, "residual:3", "taylorseer")):
        with pytest.raises(UserError, match=fragment) as info:
            pipe(PROMPT, steps=3, cache=spec, loop="loop")
        assert "\n" not in str(info.value) and "compile-loop --cache" in str(info.value)


def test_compile_loop_cache_errors(tmp_path):
    for kw, fragment in ((dict(cache="teacache:2"), "unknown cache method"),
                         (dict(cache="deepcache", form="unrolled", steps=2), "--form loop"),
                         (dict(cache="deepcache", whole=True), "--form loop"),
                         (dict(cache="first_block"), "UNet")):
        with pytest.raises(UserError, match=fragment) as info:
            compile_loop(SD, tmp_path / "out", **kw)
        assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model,compiled_with,spec", [(SD, "deepcache", "deepcache:2"),
                                                      (MMDIT, "first_block", "first_block:0.25")])
def test_loop_cache_from_a_picture_matches_the_host_loop(compiled, monkeypatch, model, compiled_with, spec):
    """img2img: the run starts at a later table row, and both loops count the cache's steps from 0."""
    from onnxdiffusion.evaluate import scenes

    pipe = Pipeline.from_folder(compiled(model, compiled_with))
    host_made, loop_runs = _host_full_steps(monkeypatch), _loop_full_steps(pipe)
    rgb = scenes.render(scenes.sample_scene(3, "heldout"))
    kw = dict(steps=12, seed=5, image=rgb, strength=0.7, cache=spec)
    host, loop = pipe(PROMPT, **kw), pipe(PROMPT, loop="loop", **kw)
    assert loop_runs[-1] == host_made[-1].full_steps and len(host_made[-1].full_steps) < 8
    assert psnr(loop.latents, host.latents, data_range=float(np.abs(host.latents).max())) >= 60.0
