"""int8-static on transformers: op groups found from the graph and chosen by measured sensitivity,
fused attention decomposed, SmoothQuant smoothing, Gemms as int4 MatMuls. Tiny real graphs."""

import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.quantize import Int4WeightsRecipe, Int8StaticRecipe, recipe_from_dict
from onnxdiffusion.quantize.calibration import CalibrationSet
from onnxdiffusion.onnxio.attention import decompose_attention
from onnxdiffusion.quantize.opgroups import (apply_smoothing, attention_matmuls, gemms_as_matmuls,
                                             modulation_nodes, smoothable, smoothing_scales)
from onnxdiffusion.quantize.recipes import prepare_unet
from onnxdiffusion.quantize.static_plan import channel_absmax, plan_static

pytestmark = pytest.mark.slow

F = TensorProto.FLOAT
B, T, D = 2, 8, 16


def run(model, feed):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def w(rng, *shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def spike(gain: float) -> np.ndarray:
    return np.where(np.arange(T) == 0, gain, 1.0).astype(np.float32).reshape(T, 1)


def backbone(norm_spike: float = 1.0, query_spike: float = 1.0, seed: int = 0, input_spike: float = 1.0) -> onnx.ModelProto:
    """A tiny transformer block with every op group: a base linear, a modulation Gemm fed by the
    timestep only (through Shape(sample) as exporters do), attention matmuls of two activations,
    a softmax, a LayerNormalization, an output linear. A spike multiplies token 0 of the norm's
    input (`norm_spike`: per-tensor int8 then crushes every other token, which the scale-invariant
    norm blows up again) or of the queries (`query_spike`: the other tokens' attention is lost) or
    of the first linear's input, undone on its output (`input_spike`: that one linear's activations
    lose their precision)."""
    rng = np.random.default_rng(seed)
    inits = {
        "w0": w(rng, D, D), "wm": w(rng, 4, D), "wq": w(rng, D, D), "wk": w(rng, D, D),
        "wv": w(rng, D, D), "wo": w(rng, D, D), "gamma": np.ones(D, np.float32), "beta": np.zeros(D, np.float32),
        "spike": spike(norm_spike), "qspike": spike(query_spike), "ispike": spike(input_spike), "iunspike": 1.0 / spike(input_spike), "one": np.ones(1, np.float32),
        "idx0": np.array(0, np.int64), "t_shape": np.array([-1, 1], np.int64), 
        "ax1": np.array([1], np.int64), "freq": np.array([[1.0, 0.5, 0.25, 0.125]], np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["sample"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "idx0"], ["bsz"], name="bsz"),
        helper.make_node("Reshape", ["timestep", "t_shape"], ["t2"], name="t2"),
        helper.make_node("Mul", ["t2", "freq"], ["tf"], name="tf"),
        helper.make_node("Sin", ["tf"], ["temb"], name="temb"),
        helper.make_node("Gemm", ["temb", "wm"], ["mod"], name="mod/Gemm"),
        helper.make_node("Unsqueeze", ["mod", "ax1"], ["mod3"], name="mod3"),
        helper.make_node("Mul", ["sample", "ispike"], ["x"], name="ispike"),
        helper.make_node("MatMul", ["x", "w0"], ["h0s"], name="base/MatMul"),
        helper.make_node("Mul", ["h0s", "iunspike"], ["h0"], name="iunspike"),
        helper.make_node("Add", ["mod3", "one"], ["mod1"], name="mod1"),
        helper.make_node("Mul", ["h0", "mod1"], ["h"], name="modulate"),
        helper.make_node("MatMul", ["h", "wq"], ["q0"], name="q/MatMul"),
        helper.make_node("Mul", ["q0", "qspike"], ["q"], name="qspike"),
        helper.make_node("MatMul", ["encoder_hidden_states", "wk"], ["k"], name="k/MatMul"),
        helper.make_node("MatMul", ["encoder_hidden_states", "wv"], ["v"], name="v/MatMul"),
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores/MatMul"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], name="values/MatMul"),
        helper.make_node("Mul", ["o", "spike"], ["o2"], name="spike"),
        helper.make_node("LayerNormalization", ["o2", "gamma", "beta"], ["n"], name="norm", axis=-1),
        helper.make_node("MatMul", ["n", "wo"], ["out_sample"], name="out/MatMul"),
    ]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("sample", F, ["b", T, D]), helper.make_tensor_value_info("timestep", F, ["b"]),
                        helper.make_tensor_value_info("encoder_hidden_states", F, ["b", T, D])],
        [helper.make_tensor_value_info("out_sample", F, ["b", T, D])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return prepare_unet(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def calibration(model, steps: int = 3, rows: int = 8, seed: int = 1) -> CalibrationSet:
    rng = np.random.default_rng(seed)
    samples = rng.standard_normal((steps, rows, T, D)).astype(np.float32)
    context = rng.standard_normal((rows, T, D)).astype(np.float32)
    timesteps = np.linspace(900, 100, steps).astype(np.float32)
    calib = CalibrationSet(samples, timesteps, context)
    calib.outputs = np.stack([run(model, calib.feed(s))[0] for s in range(steps)])
    return calib


def ctx_for(model):
    return types.SimpleNamespace(unet=model, threads=1, log=lambda m: None)


# -- graph structure ---------------------------------------------------------------------------

def test_groups_are_found_from_structure_not_names():
    m = backbone()
    assert modulation_nodes(m, ("Conv", "MatMul", "Gemm")) == ["mod/Gemm"]  # Shape(sample) does not count
    assert attention_matmuls(m) == ["scores/MatMul", "values/MatMul"]


@pytest.mark.parametrize("sensitive, expect_float", [(dict(norm_spike=300.0), "norms"), (dict(query_spike=30.0), "attention")])
def test_sensitivity_keeps_the_group_that_was_made_sensitive_float(sensitive, expect_float):
    model = backbone(**sensitive)
    calib = calibration(model)
    plan = plan_static(ctx_for(model), Int8StaticRecipe(group_budget=1.0), calib)
    g = plan.details["op_groups"]
    errors = g["added_relative_mse"]
    assert errors[expect_float] > g["base_relative_mse"] > errors["modulation"], g
    assert expect_float not in g["by_error"] and expect_float not in g["quantized"], g
    assert "modulation" in g["quantized"], g  # the harmless group is still quantized
    # the same graph without the outlier: the group is cheap in error and passes that test (it then
    # stays quantized only if it also makes the call faster: it has no weights to save)
    plain = backbone()
    g2 = plan_static(ctx_for(plain), Int8StaticRecipe(group_budget=1.0), calibration(plain)).details["op_groups"]
    assert expect_float in g2["by_error"], g2
    assert set(g2["quantized"]) <= set(g2["by_error"])


def test_forced_groups_override_measurement():
    model = backbone(norm_spike=300.0)
    plan = plan_static(ctx_for(model), Int8StaticRecipe(norms="int8", attention="float", softmax="float", modulation="float"),
                       calibration(model))
    assert plan.details["op_groups"]["quantized"] == ["norms"]
    assert "norm" in plan.nodes and "scores/MatMul" not in plan.nodes and "mod/Gemm" in plan.kept
    assert plan.details["op_groups"]["base_relative_mse"] is None  # nothing auto: nothing measured


def test_keep_sensitive_keeps_the_linear_made_sensitive_float_and_only_it():
    model = backbone(input_spike=100.0)
    plan = plan_static(ctx_for(model), Int8StaticRecipe(keep_sensitive=0.5), calibration(model))
    info = plan.details["sensitive_linears"]
    assert info["float"] == ["base/MatMul"], info
    assert "base/MatMul" in plan.kept and "base/MatMul" not in plan.nodes and "out/MatMul" in plan.nodes
    assert info["ranking_top"][0]["share"] > 0.5 > info["ranking_top"][1]["share"], info
    assert info["float_weight_bytes"] == D * D * 4
    # without the outlier no single linear carries half the error: all stay quantized
    plain = backbone()
    plain_plan = plan_static(ctx_for(plain), Int8StaticRecipe(keep_sensitive=0.5), calibration(plain))
    assert plain_plan.details["sensitive_linears"]["float"] == [] and "base/MatMul" in plain_plan.nodes
    # off by default: nothing measured, the spiked linear quantized
    assert "sensitive_linears" not in plan_static(ctx_for(model), Int8StaticRecipe(), calibration(model)).details


# -- fused attention ---------------------------------------------------------------------------

def test_decomposed_multihead_attention_matches_the_fused_kernel():
    rng = np.random.default_rng(0)
    heads, dh, sq, sk = 2, 8, 5, 7
    nodes = [helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], name="blk/attn/MultiHeadAttention",
                              domain="com.microsoft", num_heads=heads, scale=0.3)]
    graph = helper.make_graph(nodes, "mha", [helper.make_tensor_value_info("q", F, ["b", sq, heads * dh]),
                                             helper.make_tensor_value_info("k", F, ["b", sk, heads * dh]),
                                             helper.make_tensor_value_info("v", F, ["b", sk, heads * dh])],
                              [helper.make_tensor_value_info("o", F, None)])
    fused = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    feed = {"q": w(rng, 3, sq, heads * dh, scale=2), "k": w(rng, 3, sk, heads * dh, scale=2), "v": w(rng, 3, sk, heads * dh)}
    plain = decompose_attention(fused)
    assert not any(n.op_type == "MultiHeadAttention" for n in plain.graph.node)
    assert attention_matmuls(plain) == ["blk/attn/attn_scores/MatMul", "blk/attn/attn_values/MatMul"]
    np.testing.assert_allclose(run(plain, feed)[0], run(fused, feed)[0], atol=1e-5, rtol=1e-5)


# -- smoothing ---------------------------------------------------------------------------------

def test_smoothing_leaves_the_float_function_unchanged_and_flattens_outliers():
    rng = np.random.default_rng(3)
    # LayerNormalization (foldable) feeding two MatMuls; a Mul output (not foldable) feeding one
    gamma = (1 + rng.random(D)).astype(np.float32)
    gamma[5] = 40.0  # an outlier channel, as transformers grow them
    inits = {"g": gamma, "b": w(rng, D), "w1": w(rng, D, D), "w2": w(rng, D, 8), "w3": w(rng, D, D), "c": w(rng, D, scale=2)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w1"], ["y1"], name="m1"),
             helper.make_node("MatMul", ["n", "w2"], ["y2"], name="m2"),
             helper.make_node("Mul", ["y1", "c"], ["z"], name="scale"),
             helper.make_node("MatMul", ["z", "w3"], ["y3"], name="m3")]
    graph = helper.make_graph(nodes, "s", [helper.make_tensor_value_info("x", F, ["b", T, D])],
                              [helper.make_tensor_value_info(o, F, None) for o in ("y2", "y3")],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    groups = smoothable(model, ["m1", "m2", "m3"])
    assert groups == {"n": ["m1", "m2"], "z": ["m3"]}
    feed = {"x": w(rng, 4, T, D, scale=3)}
    calib = CalibrationSet(feed["x"][None], np.zeros(1, np.float32), np.zeros((4, 1, 1), np.float32))
    calib.feed = lambda s, rows=slice(None): {"x": feed["x"][rows]}
    absmax = channel_absmax(model, list(groups), calib)
    weights = {t: [inits[{"m1": "w1", "m2": "w2", "m3": "w3"}[m]] for m in ms] for t, ms in groups.items()}
    scales = {t: smoothing_scales(absmax[t], weights[t], 0.5) for t in groups}
    smoothed, counts = apply_smoothing(model, scales)
    assert counts == {"folded_into_norm": 1, "mul_inserted": 1, "weights_scaled": 3}
    before, after = run(model, feed), run(smoothed, feed)
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    # the activation the MatMuls now read has a flatter per-channel range
    new_absmax = channel_absmax(smoothed, ["n"], calib)["n"]
    spread = lambda a: float(a.max() / np.median(a))  # noqa: E731
    assert spread(new_absmax) < spread(absmax["n"]) / 2


def test_smoothing_scales_follow_smoothquant():
    a = np.array([8.0, 1.0, 0.0, 2.0], np.float32)
    wt = np.array([[2.0], [1.0], [3.0], [0.5]], np.float32)
    s = smoothing_scales(a, [wt], 0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0, 2.0], rtol=1e-6)  # sqrt(a) / sqrt(w); a silent channel keeps 1


# -- Gemms as 4-bit MatMuls ----------------------------------------------------------------------

def test_gemms_as_matmuls_keep_the_function():
    rng = np.random.default_rng(4)
    inits = {"wt": w(rng, 24, 16), "bias": w(rng, 24)}
    nodes = [helper.make_node("Gemm", ["x", "wt", "bias"], ["y"], name="lin/Gemm", transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["b", 16])],
                              [helper.make_tensor_value_info("y", F, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, done = gemms_as_matmuls(model, ["lin/Gemm"])
    assert done == ["lin/Gemm"] and [n.op_type for n in out.graph.node] == ["MatMul", "Add"]
    assert "wt" not in {t.name for t in out.graph.initializer}  # the transposed original is gone
    feed = {"x": w(rng, 3, 16)}
    np.testing.assert_allclose(run(out, feed)[0], run(model, feed)[0], rtol=1e-5, atol=1e-6)


# -- versions --------------------------------------------------------------------------------------

def test_version_2_dicts_keep_their_old_meaning():
    old = recipe_from_dict({"name": "int8-static", "version": 2})
    assert (old.attention, old.softmax, old.norms, old.modulation, old.smooth_alpha) == ("float", "float", "float", "int8", 0.0)
    assert Int8StaticRecipe().attention == "auto" and Int8StaticRecipe.version == 8
    assert recipe_from_dict({"name": "int8-static", "version": 4}).components == ("unet",)  # v5: components
    assert recipe_from_dict({"name": "int8-static", "version": 5}).bias_correction == 0  # v6: bias_correction
    assert recipe_from_dict({"name": "int8-static", "version": 3, "smooth_alpha": 0.5}).keep_sensitive == 0.0
    assert recipe_from_dict(Int8StaticRecipe(keep_sensitive=0.1).to_dict()).keep_sensitive == 0.1
    assert recipe_from_dict({"name": "int4-weights", "version": 2}).gemms == "keep"
    assert Int4WeightsRecipe().gemms == "int4"
