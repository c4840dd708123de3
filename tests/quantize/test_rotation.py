"""Group Hadamard rotation (quantize/rotation.py): the matrices, the numpy twin, the graph rewrite against
the twin and against the unrotated graph (R R^T = I: the fp32 output unchanged to ~1e-5), the option's
parsing and its manifest record (absent when off, so every existing recipe's bytes stay)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import Int4WeightsRecipe, Int8StaticRecipe, QuantizeConfig, quantize, recipe_class, recipe_from_dict
from onnxdiffusion.quantize.graphs import quantizable_nodes
from onnxdiffusion.quantize.rotation import (group_for, hadamard, parse_rotate, rotate_activation, rotate_columns,
                                             rotate_linears, rotate_weight, rotated_linear)

F = TensorProto.FLOAT
T, K, N, K2 = 6, 64, 32, 48  # K2: rotated by order 16, the largest power of 4 dividing it


def run(model, feed, outputs=None):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, feed)


@pytest.mark.parametrize("order", [16, 64, 256])
def test_hadamard_is_symmetric_orthogonal_and_regular(order):
    h = hadamard(order)
    assert np.allclose(h, h.T) and np.allclose(h @ h.T, np.eye(order), atol=1e-12)
    sums = h.sum(axis=1)
    assert np.allclose(sums, sums[0])  # regular: every row sums alike
    assert np.allclose(np.abs(h), 1 / np.sqrt(order))


def test_group_for_picks_the_largest_order_that_divides():
    assert group_for(3072, 64) == 64 and group_for(160, 64) == 16 and group_for(48, 64) == 16
    assert group_for(256, 256) == 256 and group_for(20, 64) == 0 and group_for(64, 16) == 16


def test_numpy_twin_leaves_a_linear_unchanged_and_spreads_an_outlier():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, T, K)).astype(np.float32)
    x[..., 5] *= 50  # one outlier channel
    w = rng.standard_normal((K, N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    np.testing.assert_allclose(rotated_linear(x, w, 64, b), x @ w + b, rtol=1e-5, atol=2e-4)
    xr = rotate_activation(x, 64)
    assert np.abs(xr).max() < 0.5 * np.abs(x).max()  # the outlier spread over its group
    np.testing.assert_allclose(rotate_activation(xr, 64), x, atol=1e-3)  # H is its own inverse
    np.testing.assert_allclose(rotate_columns(w, 16), rotate_activation(w, 16), atol=1e-5)
    blocks = np.concatenate([hadamard(16) @ w[i:i + 16] for i in range(0, K, 16)])  # R^T W, one group at a time
    np.testing.assert_allclose(rotate_weight(w, 16), blocks, atol=1e-4)


def _graph(rng) -> onnx.ModelProto:
    """LayerNorm -> (q MatMul, Gemm transB) sharing one input; q and a MatMul + bias Add producer, each read only by a
    rotated MatMul (folded); a graph input of width 48 (order 16) read by a Gemm; a width-20 MatMul (left)."""
    inits = {
        "g": np.ones(K, np.float32), "b": np.zeros(K, np.float32),
        "wq": rng.standard_normal((K, N)).astype(np.float32), "wt": rng.standard_normal((N, K)).astype(np.float32),
        "bt": rng.standard_normal(N).astype(np.float32), "w0": rng.standard_normal((N, K)).astype(np.float32),
        "b0": rng.standard_normal(K).astype(np.float32), "w1": rng.standard_normal((K, N)).astype(np.float32),
        "wc": rng.standard_normal((K2, N)).astype(np.float32), "w20": rng.standard_normal((20, N)).astype(np.float32),
    }
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["h"], name="ln", axis=-1),
        helper.make_node("MatMul", ["h", "wq"], ["q"], name="q"),
        helper.make_node("Gemm", ["h", "wt", "bt"], ["t"], name="gemm", transB=1),
        helper.make_node("MatMul", ["q", "w0"], ["p0"], name="up"),
        helper.make_node("Add", ["p0", "b0"], ["p"], name="up_bias"),
        helper.make_node("MatMul", ["p", "w1"], ["y1"], name="down"),
        helper.make_node("Gemm", ["c", "wc"], ["yc"], name="ctx"),
        helper.make_node("MatMul", ["e", "w20"], ["y20"], name="narrow"),
    ]
    outs = [helper.make_tensor_value_info(n, F, s) for n, s in (("t", [T, N]), ("y1", [T, N]), ("yc", [2, N]),
                                                                  ("y20", [T, N]))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [T, K]),
                                           helper.make_tensor_value_info("c", F, [2, K2]),
                                           helper.make_tensor_value_info("e", F, [T, 20])], outs,
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_rewrite_agrees_with_its_numpy_twin_and_leaves_fp32_unchanged():
    rng = np.random.default_rng(1)
    model = _graph(rng)
    feed = {"x": rng.standard_normal((T, K)).astype(np.float32), "c": rng.standard_normal((2, K2)).astype(np.float32),
            "e": rng.standard_normal((T, 20)).astype(np.float32)}
    names = [q.name for q in quantizable_nodes(model, ("MatMul", "Gemm"))]
    rotated, counts = rotate_linears(model, names, 64)
    onnx.checker.check_model(rotated)
    # q's output and up's (+ bias) are read by rotated linears only: rotated by their producers' columns
    assert counts["linears"] == 5 and counts["folded_into_producer"] == 2 and counts["rotation_matmuls"] == 2
    assert counts["rotation_orders"] == {"64": 1, "16": 1}
    before, after = run(model, feed), run(rotated, feed)
    for a, b in zip(before, after):  # R R^T = I: the fp32 output unchanged before any quantization
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    # the graph's rotated activations are the twin's x R
    probe = onnx.ModelProto()
    probe.CopyFrom(rotated)
    probe.graph.output.extend([helper.make_tensor_value_info(n, F, None) for n in ("h/rotated", "c/rotated", "h")])
    h_rot, c_rot, h = run(probe, feed, ["h/rotated", "c/rotated", "h"])
    np.testing.assert_allclose(h_rot, rotate_activation(h, 64), atol=1e-5)
    np.testing.assert_allclose(c_rot, rotate_activation(feed["c"], 16), atol=1e-5)
    # the rotation MatMuls are not linears any quantizer would pick: their H is a Constant, not an initializer
    left = {q.name for q in quantizable_nodes(rotated, ("MatMul", "Gemm"))}
    assert left == set(names) and not any("hadamard" in n for n in left)
    # the twin of the whole rotated linear, weights as stored
    inits = {t.name: numpy_helper.to_array(t) for t in rotated.graph.initializer}
    by_name = {n.name: n for n in rotated.graph.node}
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_allclose(inits[by_name["gemm"].input[1]], rotate_weight(original["wt"].T, 64).T, atol=1e-5)
    np.testing.assert_allclose(inits[by_name["q"].input[1]], rotate_columns(rotate_weight(original["wq"], 64), 16), atol=1e-4)
    np.testing.assert_allclose(inits[by_name["up"].input[1]], rotate_columns(rotate_weight(original["w0"], 16), 64), atol=1e-4)
    np.testing.assert_allclose(inits[by_name["up_bias"].input[1]], rotate_activation(original["b0"], 64), atol=1e-5)
    assert by_name["narrow"].input[0] == "e"  # width 20: no rotation order, untouched


def test_rotate_option_parses_and_is_recorded_only_when_on():
    assert parse_rotate("none") == 0 and parse_rotate("hadamard") == 64 and parse_rotate("hadamard:16") == 16
    for bad in ("hadamard:32", "hadamard:x", "givens", "none:4"):
        with pytest.raises(UserError, match="rotate"):
            parse_rotate(bad)
    with pytest.raises(UserError, match="rotate"):
        recipe_class("int8-static").with_options({"rotate": "hadamard:12"})
    # off: the dict (the manifest's record) is exactly what it was before the option existed
    assert "rotate" not in Int8StaticRecipe().to_dict() and "rotate" not in Int4WeightsRecipe().to_dict()
    on = Int8StaticRecipe(rotate="hadamard:16")
    assert on.to_dict()["rotate"] == "hadamard:16" and recipe_from_dict(on.to_dict()) == on
    assert recipe_from_dict(Int8StaticRecipe().to_dict()).rotate == "none"
    w4a8 = recipe_class("w4a8")()
    assert (w4a8.rotate, w4a8.accuracy_level) == ("hadamard", 4) and recipe_from_dict(w4a8.to_dict()) == w4a8
    with pytest.raises(UserError, match="accuracy_level must be 4"):
        recipe_class("w4a8").with_options({"accuracy_level": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("name,options", [("int8-static", {"rotate": "hadamard:16"}), ("w4a8", {"block_size": "16"})])
def test_rotated_recipes_quantize_the_tiny_pipeline(name, options, tiny_onnx, tmp_path):
    from onnxdiffusion.quantize import CalibrationConfig

    cfg = QuantizeConfig(recipe=recipe_class(name).with_options(options), calibration=CalibrationConfig(count=4, steps=2),
                         latency_runs=1, measure_memory=False)
    report = quantize(tiny_onnx, tmp_path / "q", cfg)
    assert report["details"]["rotation"]["linears"] > 0
    model = onnx.load(str(tmp_path / "q" / "unet" / "model.onnx"))
    assert any(n.name.endswith("/hadamard") for n in model.graph.node)


def test_a_patchify_conv_reads_rotated_patches_and_computes_the_same():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 4, 2, 2)).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="patch", kernel_shape=[2, 2], strides=[2, 2])
    same = helper.make_node("Conv", ["x", "w3"], ["z"], name="padded", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph([conv, same], "g", [helper.make_tensor_value_info("x", F, [2, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", F, [2, 64, 4, 4]), helper.make_tensor_value_info("z", F, [2, 64, 8, 8])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
                               numpy_helper.from_array(rng.standard_normal((64, 4, 3, 3)).astype(np.float32), "w3")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rotated, counts = rotate_linears(model, ["patch", "padded"], 64)
    assert counts.get("patchify_convs") == 1  # the padded 3x3 conv is no patch linear: left as it was
    feed = {"x": rng.standard_normal((2, 4, 8, 8)).astype(np.float32)}
    for a, r in zip(run(model, feed), run(rotated, feed)):
        np.testing.assert_allclose(r, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    # the twin: each 2x2x4 patch, flattened as the conv weight is (C, kh, kw), times R = H16, then W R
    x = feed["x"]
    patches = x.reshape(2, 4, 4, 2, 4, 2).transpose(0, 2, 4, 1, 3, 5).reshape(2, 4, 4, 16)
    y = rotate_activation(patches, 16) @ rotate_weight(w.reshape(64, 16).T, 16) + b
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), run(model, feed)[0], rtol=1e-4, atol=1e-4)
    assert {q.name for q in quantizable_nodes(rotated, ("Conv",))} == {"patch", "padded"}
