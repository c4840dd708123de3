"""Empirical bias correction (quantize/bias_correction.py, int8-static -O bias_correction=1)."""

from __future__ import annotations

import types

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import Int8StaticRecipe, recipe_class, recipe_from_dict
from onnxdiffusion.quantize import _ort
from onnxdiffusion.quantize.bias_correction import correct_biases, local_errors, targets
from onnxdiffusion.quantize.calibration import CalibrationSet
from onnxdiffusion.quantize.recipes import build_static, prepare_unet

pytestmark = pytest.mark.slow

F = TensorProto.FLOAT
C, H, W, K, N, O = 4, 6, 6, 8, 16, 4  # conv in/out channels, MatMul widths


def run(model, feed, outputs=None):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(outputs, feed)


def backbone(seed: int = 0):
    """sample -> Conv (bias) -> tokens -> MatMul + Add (bias) -> Relu -> MatMul (no bias) -> out_sample."""
    rng = np.random.default_rng(seed)
    inits = {
        "conv_w": (rng.standard_normal((K, C, 3, 3)) * 0.3).astype(np.float32),
        "conv_b": (rng.standard_normal(K) * 0.1).astype(np.float32),
        "tok_shape": np.array([0, K, H * W], np.int64),
        "w1": (rng.standard_normal((K, N)) * 0.4).astype(np.float32),
        "b1": (rng.standard_normal(N) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((N, O)) * 0.4).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["sample", "conv_w", "conv_b"], ["c"], name="conv/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "tok_shape"], ["ct"], name="tok/Reshape"),
        helper.make_node("Transpose", ["ct"], ["t"], name="tok/Transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["t", "w1"], ["m1"], name="fc1/MatMul"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="fc1/Add"),
        helper.make_node("Relu", ["a1"], ["r"], name="act/Relu"),
        helper.make_node("MatMul", ["r", "w2"], ["out_sample"], name="fc2/MatMul"),
    ]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("sample", F, ["b", C, H, W]),
        helper.make_tensor_value_info("timestep", F, ["b"]),
        helper.make_tensor_value_info("encoder_hidden_states", F, ["b", 3, 5]),
    ], [helper.make_tensor_value_info("out_sample", F, ["b", H * W, O])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return prepare_unet(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def calibration(model, steps: int = 3, rows: int = 8, seed: int = 1) -> CalibrationSet:
    rng = np.random.default_rng(seed)
    # channel means far from zero: the weights' rounding error then shifts every position alike
    offsets = np.array([1.5, -0.8, 0.6, 2.0], np.float32)[:, None, None]
    samples = (rng.standard_normal((steps, rows, C, H, W)) + offsets).astype(np.float32)
    calib = CalibrationSet(samples, np.linspace(900, 100, steps).astype(np.float32),
                           rng.standard_normal((rows, 3, 5)).astype(np.float32))
    calib.outputs = np.stack([run(model, calib.feed(s))[0] for s in range(steps)])
    return calib


NODES = ["conv/Conv", "fc1/MatMul", "fc2/MatMul"]


def quantizer(model, calib):
    from onnxdiffusion.quantize.calibration import step_ranges
    from onnxdiffusion.quantize.graphs import activation_tensors

    ranges = step_ranges(model, activation_tensors(model, NODES), calib).aggregate(None, "max")
    return lambda m: _ort.qdq_quantize(m, ranges, NODES, ("Conv", "MatMul"), "uint8", ("MatMul",))


def _dq(qdq, name):
    """(int values, scale, zero point) of the initializers a DequantizeLinear node reads, by its output."""
    inits = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    node = next(n for n in qdq.graph.node if n.output[0] == name)
    return node, [inits.get(x) for x in node.input]


def _fake_quant_input(qdq, node_name, x):
    """The node's input 0 as the quantized graph sees it: x through its Q/DQ pair (numpy)."""
    node = next(n for n in qdq.graph.node if n.name == node_name)
    dq, (_, scale, zp) = _dq(qdq, node.input[0])
    q = np.clip(np.round(x / scale) + zp.astype(np.float64), 0, 255)  # uint8 activations, round half to even
    return (q - zp.astype(np.float64)) * scale


def _weight(qdq, node_name):
    node = next(n for n in qdq.graph.node if n.name == node_name)
    _, (w, scale, zp) = _dq(qdq, node.input[1])
    axis = next((a.i for a in _dq(qdq, node.input[1])[0].attribute if a.name == "axis"), 1)
    shape = [1] * w.ndim
    shape[axis] = -1
    return (w.astype(np.float64) - zp.reshape(shape)) * scale.reshape(shape)


def test_each_linear_error_is_the_eager_numpy_one_and_is_folded_into_its_bias():
    model = backbone()
    calib = calibration(model)
    quantize = quantizer(model, calib)
    qdq = quantize(model)
    tgts = targets(model, NODES)
    assert [(t.node, t.axis, t.bias) for t in tgts] == [("conv/Conv", 1, "conv_b"), ("fc1/MatMul", -1, "b1"), ("fc2/MatMul", -1, None)]
    errs = local_errors(model, qdq, tgts, calib)
    # eager: the fp32 activations into fc1 and fc2, through each one's Q/DQ and int8 weights, numpy matmuls
    t_all, r_all = [], []
    for s in range(calib.num_steps):
        t, r = _inner(model, calib.feed(s))
        t_all.append(t)
        r_all.append(r)
    t, r = np.concatenate(t_all).astype(np.float64), np.concatenate(r_all).astype(np.float64)
    w1 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w1")).astype(np.float64)
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w2")).astype(np.float64)
    want1 = (_fake_quant_input(qdq, "fc1/MatMul", t) @ _weight(qdq, "fc1/MatMul") - t @ w1).reshape(-1, N).mean(axis=0)
    want2 = (_fake_quant_input(qdq, "fc2/MatMul", r) @ _weight(qdq, "fc2/MatMul") - r @ w2).reshape(-1, O).mean(axis=0)
    np.testing.assert_allclose(errs["fc1/MatMul"], want1, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(errs["fc2/MatMul"], want2, rtol=1e-3, atol=1e-6)
    assert np.abs(want1).max() > 1e-4  # there is something to correct
    corrected, details = correct_biases(model, quantize, NODES, calib)
    inits = {i.name: numpy_helper.to_array(i) for i in corrected.graph.initializer}
    b1 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b1"))
    np.testing.assert_allclose(inits["b1"], b1 - errs["fc1/MatMul"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(inits["fc2/MatMul/corrected_bias"], -errs["fc2/MatMul"], rtol=1e-6, atol=1e-7)
    conv_b = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "conv_b"))
    np.testing.assert_allclose(inits["conv_b"], conv_b - errs["conv/Conv"], rtol=1e-6, atol=1e-7)
    assert details["corrected_linears"] == 3 and details["added_biases"] == 1
    # the float function moves by exactly the folded shifts (the added bias takes fc2's output name)
    feed = calib.feed(0)
    np.testing.assert_allclose(run(corrected, feed)[0], run(model, feed)[0] - errs["fc2/MatMul"].astype(np.float32)
                               + _downstream_of_fc1_and_conv(model, corrected, feed), rtol=1e-4, atol=1e-4)


def _inner(model, feed):
    from onnxdiffusion.quantize.graphs import with_outputs

    return run(with_outputs(model, ["t", "r"]), feed, ["t", "r"])


def _downstream_of_fc1_and_conv(model, corrected, feed):
    """What the changed conv and fc1 biases alone do to the output (fc2's own shift excluded)."""
    from onnxdiffusion.quantize.graphs import with_outputs

    r_new = run(with_outputs(corrected, ["r"]), feed, ["r"])[0]
    r_old = run(with_outputs(model, ["r"]), feed, ["r"])[0]
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w2"))
    return (r_new - r_old) @ w2


def test_corrected_graph_has_smaller_per_channel_mean_error_on_calibration_feeds():
    model = backbone(seed=3)
    calib = calibration(model, seed=4)
    quantize = quantizer(model, calib)
    corrected, _ = correct_biases(model, quantize, NODES, calib)

    def channel_mean_error(q):
        got = np.stack([run(q, calib.feed(s))[0] for s in range(calib.num_steps)])
        return np.abs((got.astype(np.float64) - calib.outputs).reshape(-1, O).mean(axis=0))

    before, after = channel_mean_error(quantize(model)), channel_mean_error(quantize(corrected))
    assert after.mean() < 0.5 * before.mean(), (before, after)


def test_option_is_versioned_and_checked():
    r = recipe_class("int8-static").with_options({"bias_correction": "1"})
    assert r.bias_correction == 1 and Int8StaticRecipe.version == 8
    assert recipe_from_dict(r.to_dict()).bias_correction == 1
    assert recipe_from_dict({"name": "int8-static", "version": 4}).bias_correction == 0
    with pytest.raises(UserError, match="bias_correction"):
        Int8StaticRecipe(bias_correction=2)
    for name in ("int8-timestep", "mixed", "int8-naive"):
        with pytest.raises(UserError, match="bias_correction"):
            recipe_class(name).with_options({"bias_correction": "1"})


def test_build_static_with_bias_correction_reports_it_and_lowers_the_output_error():
    model = backbone(seed=5)
    calib = calibration(model, seed=6)
    ctx = types.SimpleNamespace(unet=model, threads=1, log=lambda m: None, get_calibration=lambda: calib)
    opts = {"attention": "float", "softmax": "float", "norms": "float", "modulation": "float"}
    plain = build_static(ctx, Int8StaticRecipe(**opts))
    fixed = build_static(ctx, Int8StaticRecipe(**opts, bias_correction=1))
    assert "bias_correction" not in plain.details and fixed.details["bias_correction"]["corrected_linears"] == 3

    def mse(built):
        got = np.stack([run(built.components["unet"], calib.feed(s))[0] for s in range(calib.num_steps)])
        return float(np.mean((got.astype(np.float64).mean(axis=(1, 2)) - calib.outputs.mean(axis=(1, 2))) ** 2))

    assert mse(fixed) < mse(plain)
