"""Low-bit float formats: the numpy twin vs ONNX's reference evaluator, ml_dtypes and ONNX Runtime;
the FP8 / NVFP4 graphs (portable, TensorRT form, fp32 simulation) on tiny models."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxdiffusion.quantize import lowbit as L
from onnxdiffusion.quantize import lowbit_graphs as G


def _values(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-14, 9, n))).astype(np.float32)
    edges = [448, 449, 464, 480, 500, 1e6, -1e6, 0, -0.0, 2**-9, 2**-10, 3 * 2**-11, 6, 7, 6.5, 5, 0.25, 0.75, 1.25, 2.5]
    return np.concatenate([x, np.float32(edges)])


def test_grid_rounding_matches_ml_dtypes_with_saturation():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = _values()
    np.testing.assert_array_equal(L.fp8_e4m3(x), np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(L.fp4_e2m1(x), np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    # ties go to even: 5 lies between 4 and 6 (6 has the even mantissa), 2.5 between 2 and 3
    assert L.fp4_e2m1(np.float32([5.0, 2.5, 0.25, 0.75]))[:].tolist() == [4.0, 2.0, 0.0, 1.0]
    assert L.fp8_e4m3(np.float32([1e9, -1e9]))[:].tolist() == [448.0, -448.0]


def _qdq_model(elem, scale, axis=None, block=None, opset=19):
    q_attrs = {} if axis is None else {"axis": axis}
    if block:
        q_attrs["block_size"] = block
    zero = helper.make_tensor("z", elem, list(scale.shape), np.zeros(scale.size, np.float32).tolist())
    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **q_attrs),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **q_attrs)],
        "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        [numpy_helper.from_array(scale.astype(np.float32), "s"), zero])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def test_fp8_twin_equals_reference_and_onnxruntime():
    x = _values().reshape(-1, 4)
    s = np.float32(0.37)
    m = _qdq_model(TensorProto.FLOAT8E4M3FN, np.array(s))
    want = L.fp8_fake(x, s)
    assert np.nanmax(np.abs(ReferenceEvaluator(m).run(None, {"x": x})[0] - want)) <= 1e-6
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.nanmax(np.abs(got - want)) <= 1e-6
    # per channel (axis 1)
    scales = np.float32([0.01, 1.0, 3.0, 100.0])
    m = _qdq_model(TensorProto.FLOAT8E4M3FN, scales, axis=1)
    assert np.nanmax(np.abs(ReferenceEvaluator(m).run(None, {"x": x})[0] - L.fp8_fake(x, scales, 1))) <= 1e-6


def test_fp4_block_twin_equals_reference():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 48)) * 3).astype(np.float32)
    t = L.nvfp4_quantize(x, axis=1)
    scales = t.scales()  # (6, 3): one per 16 along axis 1
    assert scales.shape == (6, 3)
    m = _qdq_model(TensorProto.FLOAT4E2M1, scales, axis=1, block=16, opset=23)
    got = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert np.max(np.abs(got - t.dequantize())) <= 1e-6
    assert np.max(np.abs(got - L.nvfp4_fake(x, axis=1))) <= 1e-6
    # the per-tensor scale puts the largest block scale at E4M3's max
    assert np.isclose(t.block_scales.max(), 448.0)
    assert set(np.unique(np.abs(t.values))) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_nvfp4_two_level_dequantize_graph_equals_twin():
    """Model Optimizer's weight pattern: DQ(E4M3 block scales, f32 scale) -> DQ(E2M1 values, scales)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((8, 40)) * np.exp(rng.uniform(-3, 3, (8, 1)))).astype(np.float32)
    t = L.nvfp4_quantize(w, axis=-1)
    inits = [G.fp4_tensor("w4", t.values), G.fp8_tensor("s8", t.block_scales), G._scalar("s2", float(t.tensor_scale))]
    g = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["s8", "s2"], ["s"]),
         helper.make_node("DequantizeLinear", ["w4", "s"], ["w"], axis=-1, block_size=16),
         helper.make_node("Identity", ["w"], ["y"])],
        "two_dq", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 40])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(m, full_check=True)
    got = ReferenceEvaluator(m).run(None, {})[0]
    assert np.max(np.abs(got - L.nvfp4_fake(w, axis=-1))) <= 1e-6
    err = np.mean((got - w) ** 2) / np.mean(w**2)
    assert 10 * np.log10(1 / err) > 15  # 4-bit with block scales: ~20 dB on Gaussian weights


# --- graphs on a tiny model with a MatMul, a Gemm and a Conv -------------------------------------

@pytest.fixture(scope="module")
def tiny():
    rng = np.random.default_rng(3)

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), f"w{len(shape)}_{shape[0]}")

    inits = [w(32, 48), w(40, 32), w(16, 32, 3, 3), numpy_helper.from_array(np.zeros(40, np.float32), "bias")]
    nodes = [helper.make_node("MatMul", ["a", inits[0].name], ["ya"], name="mm"),
             helper.make_node("Gemm", ["b", inits[1].name, "bias"], ["yb"], transB=1, name="gemm"),
             helper.make_node("Conv", ["c", inits[2].name], ["yc"], pads=[1, 1, 1, 1], name="conv")]
    g = helper.make_graph(nodes, "tiny",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 5, 32]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 32]),
                           helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 32, 6, 6])],
                          [helper.make_tensor_value_info("ya", TensorProto.FLOAT, [2, 5, 48]),
                           helper.make_tensor_value_info("yb", TensorProto.FLOAT, [3, 40]),
                           helper.make_tensor_value_info("yc", TensorProto.FLOAT, [1, 16, 6, 6])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"a": rng.standard_normal((2, 5, 32)).astype(np.float32), "b": rng.standard_normal((3, 32)).astype(np.float32),
             "c": rng.standard_normal((1, 32, 6, 6)).astype(np.float32)}
    ranges = {k: (float(v.min()), float(v.max())) for k, v in feeds.items()}
    return model, feeds, ranges


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _close(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) <= tol * max(1.0, float(np.max(np.abs(y)))), np.max(np.abs(x - y))


def _sqnr(ref, got):
    return 10 * np.log10(sum(float(np.sum(r**2)) for r in ref) / sum(float(np.sum((r - g) ** 2)) for r, g in zip(ref, got)))


def test_fp8_graph_portable_runs_on_cpu_and_equals_its_simulation(tiny):
    model, feeds, ranges = tiny
    q = G.fp8_graph(model, ["mm", "gemm", "conv"], ranges, opset=21)
    onnx.checker.check_model(q, full_check=True)
    assert next(o.version for o in q.opset_import if o.domain == "") == 21
    assert {t.data_type for t in q.graph.initializer} >= {TensorProto.FLOAT8E4M3FN}
    assert not {t.name for t in model.graph.initializer if t.name != "bias"} & {t.name for t in q.graph.initializer}
    got = _ort(q, feeds)
    _close(got, ReferenceEvaluator(q).run(None, feeds))
    _close(got, _ort(G.simulation_graph(model, ["mm", "gemm", "conv"], "fp8", "fp8", ranges), feeds))
    assert 25 < _sqnr(_ort(model, feeds), got) < 60  # quantized, and not garbage


@pytest.mark.parametrize("activations", ["fp16", "fp8"])
def test_nvfp4_portable_passes_checker_and_equals_its_simulation(tiny, activations):
    model, feeds, ranges = tiny
    q = G.nvfp4_graph(model, ["mm", "gemm", "conv"], activations, ranges, form="portable")
    onnx.checker.check_model(q, full_check=True)
    assert next(o.version for o in q.opset_import if o.domain == "") == 23
    types = {t.data_type for t in q.graph.initializer}
    assert TensorProto.FLOAT4E2M1 in types and TensorProto.FLOAT8E4M3FN in types
    dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)]
    assert len(dq) == 3 and all(helper.get_attribute_value(a) == 16 for n in dq for a in n.attribute if a.name == "block_size")
    ref = ReferenceEvaluator(q).run(None, feeds)
    sim = _ort(G.simulation_graph(model, ["mm", "gemm", "conv"], "nvfp4", activations, ranges), feeds)
    if activations == "fp16":  # the portable graph leaves activations fp32; the simulation rounds them to fp16
        assert _sqnr(ref, sim) > 50
    else:
        _close(ref, sim)
    assert 12 < _sqnr(_ort(model, feeds), ref) < 40


def test_nvfp4_tensorrt_form_has_model_optimizers_structure(tiny):
    model, feeds, ranges = tiny
    q = G.nvfp4_graph(model, ["mm", "gemm"], "fp4", ranges, form="tensorrt")
    opsets = {o.domain: o.version for o in q.opset_import}
    assert opsets[""] == 23 and opsets["trt"] == 1
    ops = [(n.domain, n.op_type) for n in q.graph.node]
    assert ops.count(("trt", "TRT_FP4DynamicQuantize")) == 2
    assert ops.count(("trt", "DequantizeLinear")) == 4  # scales, then values, per activation
    assert ops.count(("", "DequantizeLinear")) == 4  # the same two per weight, default domain
    dyn = next(n for n in q.graph.node if n.op_type == "TRT_FP4DynamicQuantize")
    attrs = {a.name: helper.get_attribute_value(a) for a in dyn.attribute}
    assert attrs == {"axis": -1, "block_size": 16, "scale_type": TensorProto.FLOAT8E4M3FN}
    # the MatMul weight is stored (out, in) and transposed back, as a torch Linear exports
    mm = next(n for n in q.graph.node if n.name == "mm")
    assert next(n for n in q.graph.node if mm.input[1] in n.output).op_type == "Transpose"
    vi = {v.name: v.type.tensor_type.elem_type for v in q.graph.value_info}
    for n in q.graph.node:
        if n.domain == "trt":
            want = G.TRT_OUTPUT_TYPES[n.op_type]
            assert tuple(vi[o] for o in n.output) == want
    onnx.checker.check_model(q, full_check=False)
    with pytest.raises(Exception):
        G.nvfp4_graph(model, ["mm"], "fp4", ranges, form="portable")


def test_layers_kept_16bit_in_stored_and_simulated_graphs():
    """Two MatMuls read one activation; one quantized (FP8 / NVFP4), one kept 16-bit: the kept one reads
    float16-rounded weights (stored float16) and, in the simulation, float16-rounded inputs; the quantized one
    keeps its own Q/DQ (one rounded twin per tensor and kind)."""
    rng = np.random.default_rng(5)
    wq, wk = (rng.standard_normal((32, 16)) * 0.3).astype(np.float32), (rng.standard_normal((32, 16)) * 0.3).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "wq"], ["yq"], name="q"),
                           helper.make_node("MatMul", ["x", "wk"], ["yk"], name="k")], "two",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [4, 16]) for y in ("yq", "yk")],
                          [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(wk, "wk")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = (rng.standard_normal((4, 32)) * 3).astype(np.float32)
    ranges = {"x": (float(x.min()), float(x.max()))}
    h = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    fp8 = G.fp8_graph(model, ["q"], ranges, 21, keep16=["k"])
    onnx.checker.check_model(fp8, full_check=True)
    assert [t.data_type for t in fp8.graph.initializer if t.name.startswith("wk")] == [TensorProto.FLOAT16]
    yq, yk = _ort(fp8, {"x": x})
    np.testing.assert_allclose(yk, x @ h(wk), rtol=1e-5, atol=1e-5)  # stored: fp16 weights, inputs as they come
    want_q = L.fp8_fake(x, L.fp8_scale(np.abs(x).max())) @ L.fp8_fake(wq, L.channel_scale(wq, 1), 1)
    np.testing.assert_allclose(yq, want_q, rtol=1e-5, atol=1e-5)
    sim = G.simulation_graph(model, ["q"], "fp8", "fp8", ranges, keep16=["k"])
    sq, sk = _ort(sim, {"x": x})
    np.testing.assert_allclose(sk, h(x) @ h(wk), rtol=1e-5, atol=1e-5)  # simulated: inputs rounded to fp16 too
    np.testing.assert_allclose(sq, want_q, rtol=1e-5, atol=1e-5)
    nv = G.nvfp4_graph(model, ["q"], "fp8", ranges, keep16=["k"])
    onnx.checker.check_model(nv, full_check=True)
    np.testing.assert_allclose(ReferenceEvaluator(nv).run(None, {"x": x})[1], x @ h(wk), rtol=1e-5, atol=1e-5)
