"""int8-static rounding=portable (quantize/portable_rounding.py): every rewritten kernel is its original's twin
on ONNX Runtime CPU (float64 arithmetic cast back: within a few float32 ulps), and no float-only kernel is left."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.quantize.portable_rounding import portable_rounding

F, U8 = TensorProto.FLOAT, TensorProto.UINT8
RNG = np.random.default_rng(0)


def _model(nodes, inputs, output, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [onnx.ValueInfoProto(name=output)],
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


def _run(m, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the kernels themselves
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _x(*shape, scale=2.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


q = np.array(0.05, np.float32), np.array(128, np.uint8)
CASES = {
    "InstanceNormalization": (helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5),
                              [("x", F, [2, 4, 50])], [("s", _x(4)), ("b", _x(4))], {"x": _x(2, 4, 50)}),
    "LayerNormalization": (helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5, axis=-1),
                           [("x", F, [2, 7, 32])], [("s", _x(32)), ("b", _x(32))], {"x": _x(2, 7, 32)}),
    "QuickGelu": (helper.make_node("QuickGelu", ["x"], ["y"], domain="com.microsoft", alpha=1.702),
                  [("x", F, [3, 64])], [], {"x": _x(3, 64)}),
    "Gelu": (helper.make_node("Gelu", ["x"], ["y"], domain="com.microsoft"), [("x", F, [3, 64])], [], {"x": _x(3, 64)}),
    "Sigmoid": (helper.make_node("Sigmoid", ["x"], ["y"]), [("x", F, [3, 64])], [], {"x": _x(3, 64)}),
    "Softmax": (helper.make_node("Softmax", ["x"], ["y"], axis=-1), [("x", F, [2, 5, 16])], [], {"x": _x(2, 5, 16)}),
    "Sin": (helper.make_node("Sin", ["x"], ["y"]), [("x", F, [64])], [], {"x": _x(64, scale=30)}),
    "Cos": (helper.make_node("Cos", ["x"], ["y"]), [("x", F, [64])], [], {"x": _x(64, scale=30)}),
    "Tanh": (helper.make_node("Tanh", ["x"], ["y"]), [("x", F, [3, 64])], [], {"x": _x(3, 64, scale=3)}),
    "MatMul": (helper.make_node("MatMul", ["x", "w"], ["y"]), [("x", F, [2, 5, 16])], [("w", _x(16, 8))], {"x": _x(2, 5, 16)}),
    "MultiHeadAttention": (helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], domain="com.microsoft",
                                            num_heads=2, scale=0.3),
                           [("q", F, [2, 5, 8]), ("k", F, [2, 6, 8]), ("v", F, [2, 6, 8])], [],
                           {"q": _x(2, 5, 8), "k": _x(2, 6, 8), "v": _x(2, 6, 8)}),
    "QLinearAdd": (helper.make_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["y"], domain="com.microsoft"),
                   [("a", U8, [300]), ("b", U8, [300])], [("sa", q[0]), ("za", q[1]), ("sb", np.array(0.03, np.float32)),
                                                         ("zb", np.array(120, np.uint8)), ("sc", np.array(0.07, np.float32)),
                                                         ("zc", np.array(130, np.uint8))],
                   {"a": RNG.integers(0, 256, 300).astype(np.uint8), "b": RNG.integers(0, 256, 300).astype(np.uint8)}),
    "QLinearSoftmax": (helper.make_node("QLinearSoftmax", ["x", "sx", "zx", "sy", "zy"], ["y"], domain="com.microsoft",
                                        axis=-1, opset=13),
                       [("x", U8, [4, 32])], [("sx", np.array(0.1, np.float32)), ("zx", np.array(128, np.uint8)),
                                              ("sy", np.array(1 / 256, np.float32)), ("zy", np.array(0, np.uint8))],
                       {"x": RNG.integers(0, 256, (4, 32)).astype(np.uint8)}),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_rewritten_kernel_is_the_original_twin(op):
    node, inputs, inits, feeds = CASES[op]
    model = _model([node], inputs, "y", inits)
    want = _run(model, feeds)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    report = portable_rounding(lowered)
    assert report["lowered"] == {op: 1} and report["kept"] == {}, report
    casts = {n.output[0] for n in lowered.graph.node if n.op_type == "Cast"}
    assert all(set(n.input) <= casts for n in lowered.graph.node if n.op_type == op)  # left only as float64 twins
    got = _run(lowered, feeds)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == np.uint8:  # requantized: at most one step, rarely
        diff = np.abs(got.astype(int) - want.astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.02, (diff.max(), (diff > 0).mean())
    else:
        tol = 2e-7 if op == "Gelu" else 0.0  # Abramowitz-Stegun erf: |error| < 1.5e-7
        np.testing.assert_allclose(got, want, rtol=5e-6, atol=tol + 1e-6 * float(np.abs(want).max()))


def test_ops_it_cannot_rewrite_are_reported_and_kept():
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y"], axis=1)  # not the last axis: kept
    model = _model([node], [("x", F, [2, 3, 4])], "y", [("s", _x(3, 4))])
    assert portable_rounding(model) == {"lowered": {}, "kept": {"LayerNormalization": 1}}
    assert [n.op_type for n in model.graph.node] == ["LayerNormalization"]


def test_recipe_option():
    from onnxdiffusion.errors import UserError
    from onnxdiffusion.quantize import recipe_class

    r = recipe_class("int8-static").with_options({"rounding": "portable"})
    assert r.rounding == "portable" and recipe_class("int8-static")().rounding == "cpu"
    with pytest.raises(UserError, match="rounding"):
        recipe_class("int8-static").with_options({"rounding": "portable", "stored": "qdq"})
    with pytest.raises(UserError, match="rounding"):
        recipe_class("int8-static").with_options({"rounding": "exact"})


def test_rewritten_kernels_round_alike_on_wasm():
    """The point of the rewrite: on identical inputs onnxruntime-web's WASM build (the page's kernels, run in node)
    gives the rewritten kernels' outputs bit for bit as x86 ORT CPU does, while the original float kernels differ
    (larger inputs than above, so that the original kernels' ulps show)."""
    from onnxdiffusion.web import wasm

    if not wasm.available():
        pytest.skip("node or the page's npm packages (make web-deps) are missing")
    rng = np.random.default_rng(1)
    big = {"InstanceNormalization": {"x": (2, 4, 4096)}, "LayerNormalization": {"x": (2, 64, 256)},
           "QuickGelu": {"x": (64, 1024)}, "Gelu": {"x": (64, 1024)}, "Sigmoid": {"x": (64, 1024)},
           "Tanh": {"x": (64, 1024)}, "Softmax": {"x": (16, 64, 64)},
           "MultiHeadAttention": {"q": (2, 64, 8), "k": (2, 64, 8), "v": (2, 64, 8)}}
    jobs, names = [], []
    for op, shapes in big.items():
        node, inputs, inits, _ = CASES[op]
        if op == "InstanceNormalization":
            inits = [("s", _x(4)), ("b", _x(4))]
        elif op == "LayerNormalization":
            inits = [("s", _x(256)), ("b", _x(256))]
        feeds = {k: (rng.standard_normal(s) * 3 + (2 if "Norm" in op else 0)).astype(np.float32) for k, s in shapes.items()}
        model = _model([node], [(k, F, list(s)) for k, s in shapes.items()], "y", inits)
        lowered = onnx.ModelProto()
        lowered.CopyFrom(model)
        portable_rounding(lowered)
        for kind, m in (("original", model), ("portable", lowered)):
            cpu = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            jobs.append((m.SerializeToString(), feeds))
            names.append((op, kind, cpu))
    differ = {}
    for (op, kind, cpu), out in zip(names, wasm.run_on_wasm(jobs)):
        differ[(op, kind)] = float((out["y"] != cpu).mean())
    assert all(differ[(op, "portable")] == 0 for op in big), differ
    assert sum(differ[(op, "original")] > 0 for op in big) >= 5, differ  # the drift the rewrite removes
