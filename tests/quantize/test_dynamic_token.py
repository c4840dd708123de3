"""Per-token dynamic int8 activations (quantize/dynamic_token.py): the numpy twin against float, the graph
rewrite against the twin (ONNX Runtime's MatMulInteger int8 x int8), one token quantization per shared
input, and int8-static's `activations` option (absent from the dict when static: existing bytes kept)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import Int8StaticRecipe, recipe_class, recipe_from_dict
from onnxdiffusion.quantize.dynamic_token import (dynamic_token_linear, dynamic_token_linears, token_quantize,
                                                  token_quantize_asym, weight_quantize)

F = TensorProto.FLOAT
B, T, K, N = 2, 5, 64, 24


def run(model, feed):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def test_twin_gives_each_token_its_own_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, K)).astype(np.float32)
    x[0, 1] *= 100  # one outlier token: the others keep their resolution
    x[1, 2] = 0  # an all-zero token quantizes to zeros, not NaN
    q, s = token_quantize(x)
    assert q.dtype == np.int8 and s.shape == (B, T, 1) and np.abs(q).max() == 127
    assert np.all(q[1, 2] == 0) and np.isfinite(s).all()
    np.testing.assert_allclose(q * s, x, atol=float(s.max()) / 2 * 1.001)
    err = np.abs(q * s - x)[1, 0].max()
    assert err < 0.01 * np.abs(x[1, 0]).max()  # per-token: the outlier did not take the other rows' range
    w = rng.standard_normal((K, N)).astype(np.float32)
    wq, ws = weight_quantize(w)
    assert wq.dtype == np.int8 and ws.shape == (N,) and np.abs(wq).max() == 127
    b = rng.standard_normal(N).astype(np.float32)
    y = x @ w + b
    yq = dynamic_token_linear(x, w, b)
    assert np.abs(yq - y).max() < 0.02 * np.abs(y).max()


def _graph(rng) -> tuple[onnx.ModelProto, dict]:
    """x read by a MatMul and a Gemm (transB, bias, alpha, beta); a second input read by a MatMul left float."""
    w = {"wq": rng.standard_normal((K, N)).astype(np.float32), "wt": rng.standard_normal((N, K)).astype(np.float32),
         "bt": rng.standard_normal(N).astype(np.float32), "wf": rng.standard_normal((K, N)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("Gemm", ["x2", "wt", "bt"], ["t"], name="gemm", transB=1, alpha=0.5, beta=2.0),
             helper.make_node("MatMul", ["x", "wf"], ["f"], name="kept"),
             helper.make_node("Reshape", ["x", "shape2d"], ["x2"], name="flat")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [B, T, K])],
                              [helper.make_tensor_value_info(n, F, s) for n, s in (("q", [B, T, N]), ("t", [B * T, N]), ("f", [B, T, N]))],
                              [numpy_helper.from_array(v, k) for k, v in w.items()]
                              + [numpy_helper.from_array(np.array([B * T, K], np.int64), "shape2d")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def test_the_rewrite_agrees_with_its_twin():
    rng = np.random.default_rng(1)
    model, w = _graph(rng)
    x = rng.standard_normal((B, T, K)).astype(np.float32)
    x[:, 0] *= 30
    out, report = dynamic_token_linears(model, ["q", "gemm"])
    onnx.checker.check_model(out)
    assert report == {"linears": 2, "tensors": 2, "weights_int8": 2 * K * N}
    types = [n.op_type for n in out.graph.node]
    assert types.count("MatMulInteger") == 2 and types.count("ReduceMax") == 2 and types.count("MatMul") == 1
    assert {"wq", "wt"}.isdisjoint(t.name for t in out.graph.initializer)  # float weights gone
    q, t, f = run(out, {"x": x})
    np.testing.assert_allclose(q, dynamic_token_linear(x, w["wq"]), rtol=1e-5, atol=1e-4)
    twin = dynamic_token_linear(x.reshape(B * T, K), 0.5 * w["wt"].T, 2.0 * w["bt"])
    np.testing.assert_allclose(t, twin, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(f, x @ w["wf"], rtol=1e-5, atol=1e-4)  # not named: float


def test_readers_of_one_tensor_share_its_token_quantization():
    rng = np.random.default_rng(2)
    model, _ = _graph(rng)
    out, report = dynamic_token_linears(model, ["q", "kept"])
    assert report["tensors"] == 1 and [n.op_type for n in out.graph.node].count("ReduceMax") == 1


def test_activations_option_parses_and_is_recorded_only_when_dynamic():
    assert "activations" not in Int8StaticRecipe().to_dict()  # static: the dict as before the option existed
    on = recipe_class("int8-static").with_options({"activations": "dynamic-token", "rotate": "hadamard"})
    assert on.to_dict()["activations"] == "dynamic-token" and recipe_from_dict(on.to_dict()) == on
    assert recipe_from_dict(Int8StaticRecipe().to_dict()).activations == "static"
    asym = recipe_class("int8-static").with_options({"activations": "dynamic-token-asym"})
    assert recipe_from_dict(asym.to_dict()) == asym
    with pytest.raises(UserError, match="activations"):
        recipe_class("int8-static").with_options({"activations": "dynamic"})


def test_the_zero_point_form_agrees_with_its_twin_and_fits_one_sided_rows_better():
    rng = np.random.default_rng(3)
    model, w = _graph(rng)
    x = np.abs(rng.standard_normal((B, T, K))).astype(np.float32) + 0.5  # every row positive: symmetric wastes half
    q, s, z = token_quantize_asym(x)
    assert q.dtype == np.uint8 and np.all(z == 0)  # the zero point clamps to code 0 when the row's min is above 0
    out, _ = dynamic_token_linears(model, ["q", "gemm"], zero_point=True)
    onnx.checker.check_model(out)
    got = run(out, {"x": x})[0]
    np.testing.assert_allclose(got, dynamic_token_linear(x, w["wq"], zero_point=True), rtol=1e-5, atol=1e-4)
    centred = x - 1.0  # rows straddling zero: a zero point of its own per row
    assert (token_quantize_asym(centred)[2] > 0).all()
    ref = centred @ w["wq"]
    err_asym = np.abs(dynamic_token_linear(centred, w["wq"], zero_point=True) - ref).mean()
    err_sym = np.abs(dynamic_token_linear(centred, w["wq"]) - ref).mean()
    assert err_asym < err_sym


def test_gptq_weights_keep_the_grid_lower_the_output_error_and_are_deterministic():
    from onnxdiffusion.quantize.gptq import int8_channels

    rng = np.random.default_rng(4)
    model, w = _graph(rng)
    mix = rng.standard_normal((K, K)) * (rng.random(K) ** 2)  # correlated channels of unequal scale
    calib = (rng.standard_normal((64, K)) @ mix).astype(np.float32)
    hessians = {"x": calib.T.astype(np.float64) @ calib / len(calib)}
    out, report = dynamic_token_linears(model, ["q"], zero_point=True, hessians=hessians)
    again, _ = dynamic_token_linears(model, ["q"], zero_point=True, hessians=hessians)
    assert out.SerializeToString() == again.SerializeToString() and report["linears"] == 1
    stored = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    codes, scales = int8_channels(w["wq"], hessians["x"])
    np.testing.assert_array_equal(stored["q/token_int8/W_int8"], codes)
    nearest, _ = dynamic_token_linears(model, ["q"], zero_point=True)
    feed = {"x": calib[: B * T].reshape(B, T, K)}  # a calibration sample: what GPTQ minimized the error on
    exact = feed["x"] @ w["wq"]
    err = np.mean((run(out, feed)[0] - exact) ** 2)
    err_nearest = np.mean((run(nearest, feed)[0] - exact) ** 2)
    assert err < err_nearest


def test_weights_option_is_recorded_only_when_gptq_and_needs_dynamic_activations():
    assert "weights" not in Int8StaticRecipe().to_dict() and "gptq_steps" not in Int8StaticRecipe().to_dict()
    on = recipe_class("int8-static").with_options({"activations": "dynamic-token-asym", "weights": "gptq", "gptq_steps": "4"})
    assert on.to_dict()["weights"] == "gptq" and on.to_dict()["gptq_steps"] == 4 and recipe_from_dict(on.to_dict()) == on
    with pytest.raises(UserError, match="needs activations=dynamic-token"):
        recipe_class("int8-static").with_options({"weights": "gptq"})
    with pytest.raises(UserError, match="weights must be one of"):
        recipe_class("int8-static").with_options({"activations": "dynamic-token", "weights": "awq"})


def test_gptq_weights_refuse_a_backbone_past_the_inline_limit(monkeypatch):
    from onnxdiffusion.quantize import static_plan

    model, _ = _graph(np.random.default_rng(0))
    monkeypatch.setattr(static_plan.files, "is_large", lambda m: True)  # its Hessians run the whole backbone
    recipe = recipe_class("int8-static").with_options({"activations": "dynamic-token", "weights": "gptq"})
    with pytest.raises(UserError, match="only backbones under 2 GB"):
        static_plan.dynamic_token(model, recipe, None)
