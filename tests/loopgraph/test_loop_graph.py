"""The one-graph sampling loops (Loop and unrolled) against their eager twin, the numpy host loop."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.samplers import DISCRETE_SAMPLERS as SAMPLERS
from onnxdiffusion.samplers import build_table, guided, sample
from onnxdiffusion.loopgraph.builder import build_sampling_graph
from onnxdiffusion.samplers.schedules import NoiseSchedule

SD = NoiseSchedule(1000, 0.00085, 0.012, "scaled_linear", "epsilon", steps_offset=1)


def toy_backbone(channels=4, hidden=8) -> onnx.ModelProto:
    """A few ops standing in for a UNet, so the reference evaluator can run the whole loop."""
    f = TensorProto.FLOAT
    w = np.linspace(0.5, 1.5, channels, dtype=np.float32).reshape(1, channels, 1, 1)
    nodes = [
        helper.make_node("Mul", ["sample", "w"], ["xs"]),
        helper.make_node("Tanh", ["xs"], ["th"]),
        helper.make_node("ReduceMean", ["encoder_hidden_states"], ["ctx_mean"], axes=[1, 2], keepdims=0),
        helper.make_node("Mul", ["timestep", "t_scale"], ["t_small"]),
        helper.make_node("Add", ["ctx_mean", "t_small"], ["bias"]),
        helper.make_node("Reshape", ["bias", "bias_shape"], ["bias4"]),
        helper.make_node("Add", ["th", "bias4"], ["out_sample"]),
    ]
    graph = helper.make_graph(
        nodes, "toy",
        [
            helper.make_tensor_value_info("sample", f, ["b", channels, "h", "w"]),
            helper.make_tensor_value_info("timestep", f, ["b"]),
            helper.make_tensor_value_info("encoder_hidden_states", f, ["b", "s", hidden]),
        ],
        [helper.make_tensor_value_info("out_sample", f, ["b", channels, "h", "w"])],
        initializer=[
            onnx.numpy_helper.from_array(w, "w"),
            onnx.numpy_helper.from_array(np.array(1e-3, np.float32), "t_scale"),
            onnx.numpy_helper.from_array(np.array([-1, 1, 1, 1], np.int64), "bias_shape"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def toy_eager(model):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def batched(ctx):
        def fn(x, t):
            return sess.run(None, {"sample": x, "timestep": np.full(len(x), t, np.float32), "encoder_hidden_states": ctx})[0]
        return fn

    return batched


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("form", ["loop", "unrolled"])
def test_toy_loop_matches_host_and_reference_evaluator(sampler, form):
    rng = np.random.default_rng(0)
    steps = 6
    table = build_table(sampler, SD, steps)
    latents = rng.standard_normal((2, 4, 4, 4), dtype=np.float32)
    cond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    uncond = rng.standard_normal((2, 3, 8), dtype=np.float32)
    noise = rng.standard_normal((steps, *latents.shape), dtype=np.float32) if table.needs_noise else None
    backbone = toy_backbone()
    host = sample(guided(toy_eager(backbone)(np.concatenate([uncond, cond])), 3.0), latents, table, noise)

    graph = build_sampling_graph(backbone, form, steps if form == "unrolled" else None)
    onnx.checker.check_model(graph, full_check=True)
    feeds = {
        "latents": latents, "cond": cond, "uncond": uncond, "table": table.rows,
        "init_scale": np.array(table.init_scale, np.float32), "guidance": np.array(3.0, np.float32),
        "noise": noise if noise is not None else np.zeros((1, *latents.shape), np.float32),
    }
    if form == "loop":
        feeds["steps"] = np.array(steps, np.int64)
    got = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    ref = ReferenceEvaluator(graph).run(None, feeds)[0]
    scale = np.linalg.norm(host)
    assert np.linalg.norm(got - host) / scale < 1e-5
    assert np.linalg.norm(ref - host) / scale < 1e-5


def test_loop_runs_any_prefix_of_the_table():
    """The Loop form's trip count is an input: fewer steps than table rows is a valid run."""
    rng = np.random.default_rng(1)
    table = build_table("ddim", SD, 8)
    latents = rng.standard_normal((1, 4, 4, 4), dtype=np.float32)
    ctx = rng.standard_normal((1, 3, 8), dtype=np.float32)
    graph = build_sampling_graph(toy_backbone(), "loop")
    sess = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"latents": latents, "cond": ctx, "uncond": ctx, "table": table.rows,
             "init_scale": np.array(1.0, np.float32), "guidance": np.array(1.0, np.float32),
             "noise": np.zeros((1, *latents.shape), np.float32), "steps": np.array(3, np.int64)}
    got = sess.run(None, feeds)[0]
    partial = None
    for partial in _host_steps(toy_backbone(), latents, ctx, table, 3):
        pass
    assert np.linalg.norm(got - partial) / np.linalg.norm(partial) < 1e-5


def _host_steps(backbone, latents, ctx, table, n):
    from onnxdiffusion.samplers import iter_sample

    fn = guided(toy_eager(backbone)(np.concatenate([ctx, ctx])), 1.0)
    for i, x, _ in iter_sample(fn, latents, table):
        if i == n - 1:
            yield x
            return


@pytest.fixture(scope="module")
def tiny_loops(tiny_onnx, tmp_path_factory):
    out = tmp_path_factory.mktemp("loops") / "model"
    compile_loop(tiny_onnx, out, form="loop")
    for n in (1, 2, 10):
        compile_loop(out, out, form="unrolled", steps=n)  # in place; the last one wins
    compile_loop(out, out, form="loop", whole=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("steps", [1, 2, 10])
def test_exported_model_loop_forms_match_host(tiny_loops, sampler, steps):
    pipe = Pipeline.from_folder(tiny_loops)
    kwargs = dict(steps=steps, sampler=sampler, guidance=5.0, seed=steps, batch=2)
    host = pipe("a red circle on the left", **kwargs)
    loop = pipe("a red circle on the left", loop="loop", **kwargs)
    rel = np.linalg.norm(loop.latents - host.latents) / np.linalg.norm(host.latents)
    assert rel < 1e-4
    assert psnr(loop.images, host.images) >= 60
    if steps == 10:
        unrolled = pipe("a red circle on the left", loop="unrolled", **kwargs)
        rel = np.linalg.norm(unrolled.latents - host.latents) / np.linalg.norm(host.latents)
        assert rel < 1e-4


@pytest.mark.slow
def test_weights_stored_once(tiny_loops, tiny_onnx):
    import json

    manifest = json.loads((tiny_loops / "manifest.json").read_text())
    unet_bytes = manifest["components"]["unet"]["bytes"]
    loop_bytes = manifest["components"]["sampler_loop"]["bytes"]
    assert loop_bytes <= 1.05 * unet_bytes
    whole = manifest["components"]["sampler_loop_whole"]["bytes"]
    parts = sum(manifest["components"][c]["bytes"] for c in ("unet", "text_encoder", "vae_decoder"))
    assert whole <= 1.05 * parts


def _run_whole_graph(folder, pipe, host, prompt: str, negative: str, sampler: str, steps: int, guidance: float):
    """The folder's whole graph (token ids in, uint8 image out) run by onnxruntime alone, from `host`'s initial
    latents and the sampler table the pipeline would use."""
    table = build_table(sampler, pipe.schedule, steps)
    sess = ort.InferenceSession(str(folder / "sampler_loop_whole" / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(["image"], {
        "input_ids": pipe.tokenizer([prompt]), "uncond_input_ids": pipe.tokenizer([negative]),
        "latents": host.init_latents, "table": table.rows, "init_scale": np.array(table.init_scale, np.float32),
        "guidance": np.array(guidance, np.float32), "noise": np.zeros((1, *host.init_latents.shape), np.float32),
        "steps": np.array(steps, np.int64),
    })[0]


@pytest.mark.slow
def test_whole_graph_from_token_ids(tiny_loops):
    """token ids in, uint8 image out, with onnxruntime alone; same image as the host pipeline."""
    pipe = Pipeline.from_folder(tiny_loops)
    host = pipe("a blue star", negative_prompt="a red ring", steps=5, sampler="dpmpp_2m", guidance=4.0, seed=2)
    image = _run_whole_graph(tiny_loops, pipe, host, "a blue star", "a red ring", "dpmpp_2m", 5, 4.0)
    assert image.dtype == np.uint8 and image.shape == host.images.shape
    assert psnr(image, host.images) >= 40


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(steps=0), "step count"),
        (dict(steps=9), "step count"),
        (dict(table=np.zeros((8, 5), np.float32)), "table"),
        (dict(latents=np.zeros((1, 3, 8, 8), np.float32)), "latents"),
        (dict(noise=np.zeros((2, 1, 4, 4, 4), np.float32)), "noise"),
    ],
)
def test_bad_inputs_fail_before_the_run(tiny_loops, change, fragment):
    from onnxdiffusion.errors import UserError

    pipe = Pipeline.from_folder(tiny_loops)
    graph = pipe.sampling_graph("loop")
    table = build_table("ddim", pipe.schedule, 8)
    rows = change.get("table", table.rows)
    latents = change.get("latents", np.zeros((1, 4, 8, 8), np.float32))
    with pytest.raises(UserError, match=fragment):
        graph.check(rows, latents, change.get("noise"), change.get("steps", 8))


def test_compile_loop_errors(tiny_onnx, tmp_path):
    from onnxdiffusion.errors import UserError

    with pytest.raises(UserError, match="unrolled needs"):
        compile_loop(tiny_onnx, tmp_path / "a", form="unrolled")
    with pytest.raises(UserError, match="unknown loop form"):
        compile_loop(tiny_onnx, tmp_path / "b", form="scan")
    assert list(tmp_path.iterdir()) == []


def test_cpu_tuned_loop_matches_host(tiny_onnx, tmp_path):
    """The Loop body with ORT's fully optimized CPU graph inlined (NCHWc) still equals the host loop."""
    out = tmp_path / "tuned"
    info = compile_loop(tiny_onnx, out, form="loop", cpu_tuned=True)
    assert "ORT_ENABLE_ALL" in info["prefused"]
    pipe = Pipeline.from_folder(out)
    for sampler in ("ddim", "dpmpp_2m"):
        kw = dict(steps=6, sampler=sampler, guidance=4.0, seed=5, batch=2)
        host, loop = pipe("a red circle", **kw), pipe("a red circle", loop="loop", **kw)
        assert np.linalg.norm(loop.latents - host.latents) / np.linalg.norm(host.latents) < 1e-4


def test_loop_is_tuned_by_default_and_refused_on_another_cpu_target(tiny_onnx, tmp_path):
    """Default compile: tuned and stamped with the CPU target; a folder stamped for another target is refused
    at load with one line; --portable records no target and loads anywhere."""
    import json

    from onnxdiffusion.errors import UserError
    from onnxdiffusion.runtime.cpu_target import cpu_target

    out = tmp_path / "default"
    info = compile_loop(tiny_onnx, out, form="loop")
    assert "ORT_ENABLE_ALL" in info["prefused"] and info["tuned_for"] == cpu_target()
    Pipeline.from_folder(out).sampling_graph("loop")  # same machine: loads

    manifest = json.loads((out / "manifest.json").read_text())
    other = "avx2" if cpu_target()["isa"] != "avx2" else "avx512"
    manifest["components"]["sampler_loop"]["tuned_for"]["isa"] = other
    (out / "manifest.json").write_text(json.dumps(manifest))
    pipe = Pipeline.from_folder(out, verify=False)
    with pytest.raises(UserError, match=f"tuned for another CPU target \\(isa {other}"):
        pipe.sampling_graph("loop")
    pipe("a red circle", steps=2, seed=0)  # the host loop still runs

    portable = compile_loop(tiny_onnx, tmp_path / "portable", form="loop", cpu_tuned=False)
    assert portable["tuned_for"] is None


def test_tuned_loop_of_a_large_backbone_is_optimized_file_to_file(external_onnx, tmp_path, monkeypatch):
    """A backbone past the 2 GB limit (the limit lowered here) gets the tuned form too: ORT optimizes it from
    its folder into a file with external data, the weights never enter Python; same numbers as the
    in-memory tuned compile, and as the host loop."""
    import json

    from onnxdiffusion.loopgraph import compile as loops
    from onnxdiffusion.runtime.cpu_target import cpu_target

    small = compile_loop(external_onnx, tmp_path / "small", form="loop")
    assert small["external_data"] == []
    monkeypatch.setattr(loops, "LARGE", 64 << 10)  # the tiny UNet has ~50x this in weights
    real_load = loops.load_component

    def load(folder, manifest, name):
        assert name != "unet", "the large backbone was loaded into memory"
        return real_load(folder, manifest, name)

    monkeypatch.setattr(loops, "load_component", load)
    out = tmp_path / "large"
    info = compile_loop(external_onnx, out, form="loop")
    compile_loop(out, out, form="loop", whole=True)
    monkeypatch.undo()
    assert "ORT_ENABLE_ALL" in info["prefused"] and info["tuned_for"] == cpu_target()
    assert info["external_data"] == ["sampler_loop/model.onnx_data"]
    graph_bytes, data_bytes = ((out / "sampler_loop" / f).stat().st_size for f in ("model.onnx", "model.onnx_data"))
    assert graph_bytes < 0.1 * data_bytes  # the graph (and tensors <= 1 KB); the weights are in the data file
    whole = json.loads((out / "manifest.json").read_text())["components"]["sampler_loop_whole"]
    assert whole["external_data"] == ["sampler_loop_whole/model.onnx_data"] and whole["tuned_for"] == cpu_target()
    large_pipe, small_pipe = Pipeline.from_folder(out), Pipeline.from_folder(tmp_path / "small")
    for sampler in ("ddim", "dpmpp_2m"):
        kw = dict(steps=6, sampler=sampler, guidance=4.0, seed=5, batch=2)
        host, loop = large_pipe("a red circle", **kw), large_pipe("a red circle", loop="loop", **kw)
        assert np.array_equal(loop.latents, small_pipe("a red circle", loop="loop", **kw).latents)
        assert np.linalg.norm(loop.latents - host.latents) / np.linalg.norm(host.latents) < 1e-4
    host = large_pipe("a blue star", steps=5, sampler="ddim", guidance=4.0, seed=2)
    image = _run_whole_graph(out, large_pipe, host, "a blue star", "", "ddim", 5, 4.0)
    assert psnr(image, host.images) >= 40


@pytest.mark.slow
def test_a_pipeline_running_only_the_loop_never_loads_the_backbone(tiny_loops, monkeypatch):
    """The Loop graph holds the backbone's weights itself: a pipeline that only runs it makes no backbone
    session (at full size that would be a second copy of 3.4 GB); the host loop makes it on first use."""
    from onnxdiffusion.runtime import session_makers

    made = []
    real = session_makers._backbone_session
    monkeypatch.setattr(session_makers, "_backbone_session", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    pipe = Pipeline.from_folder(tiny_loops)
    loop = pipe("a red circle", steps=4, guidance=4.0, seed=3, loop="loop")
    assert made == []
    host = pipe("a red circle", steps=4, guidance=4.0, seed=3)
    assert len(made) == 1 and np.linalg.norm(loop.latents - host.latents) / np.linalg.norm(host.latents) < 1e-4
    pipe("a red circle", steps=2, seed=3)
    assert len(made) == 1  # made once


def test_a_swapped_backbone_still_fails_at_load(tiny_onnx, tmp_path):
    """The backbone's I/O is checked from its graph when the pipeline loads, before any session exists."""
    import json
    import shutil

    from onnxdiffusion.folder.artifacts import hash_tree
    from onnxdiffusion.errors import UserError

    out = tmp_path / "swapped"
    shutil.copytree(tiny_onnx, out)
    shutil.copy(out / "vae_decoder" / "model.onnx", out / "unet" / "model.onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] = hash_tree(out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="component 'unet' has inputs"):
        Pipeline.from_folder(out)
