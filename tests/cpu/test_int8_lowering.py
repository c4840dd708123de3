"""int8 convolutions laid out for the CPU's kernels (-O kernels=...): same results, choice by CPU features."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxdiffusion.cpu import check, features, int8_lowering
from onnxdiffusion.cpu.int8_lowering import eligible_convs, lower, plan_kernels
from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import Int8StaticRecipe, recipe_from_dict

AMX = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
VNNI = frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})
AVX2 = frozenset({"avx2", "fma"})


def _conv_graph(wzp=0, group=1, const_zp=True, batch="N"):
    """x (float) -> QuantizeLinear -> QLinearConv 3x3 -> QLinearConv 1x1 -> DequantizeLinear."""
    rng = np.random.default_rng(0)
    c, o = 8, 8
    w1 = rng.integers(-127, 128, (o, c // group, 3, 3), dtype=np.int8)
    w2 = rng.integers(-127, 128, (o, o, 1, 1), dtype=np.int8)
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (np.float32(0.05), "xs"), (np.uint8(121), "xzp"), (w1, "w1"), (np.full(o, 0.01, np.float32), "ws"),
        (np.full(o, wzp, np.int8), "wzp"), (np.float32(0.1), "ys"), (np.uint8(130), "yzp"),
        (rng.integers(-500, 500, o).astype(np.int32), "b1"), (w2, "w2"), (np.zeros(o, np.int8), "wzp2"),
        (np.float32(0.2), "zs"), (np.uint8(128), "zzp")]]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, [batch, c, 6, 6])]
    xzp = "xzp"
    if not const_zp:  # a zero point fed at run time: not eligible
        inputs.append(helper.make_tensor_value_info("xzp_in", TP.UINT8, []))
        inits = [i for i in inits if i.name != "xzp"]
        xzp = "xzp_in"
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", xzp], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "xs", xzp, "w1", "ws", "wzp", "ys", "yzp", "b1"], ["y"],
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group, name="conv3"),
             helper.make_node("QLinearConv", ["y", "ys", "yzp", "w2", "ws", "wzp2", "zs", "zzp"], ["z"], name="conv1"),
             helper.make_node("DequantizeLinear", ["z", "zs", "zzp"], ["out"])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", TP.FLOAT, [batch, 8, 6, 6])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    return m


def _ort(m):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])


def test_lowered_graph_computes_the_same_in_ort_and_the_reference():
    m = _conv_graph()
    low = copy.deepcopy(m)
    rec = lower(low)
    assert rec == {"lowered": 2, "kept": 0, "foldable": False}
    assert all(n.input[2].startswith(int8_lowering.ZP_PREFIX) for n in low.graph.node if n.op_type == "QLinearConv")
    onnx.checker.check_model(low)
    x = np.random.default_rng(1).standard_normal((2, 8, 6, 6)).astype(np.float32) * 2
    ref_a = ReferenceEvaluator(m).run(None, {"x": x})[0]
    ref_b = ReferenceEvaluator(low).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ref_a, ref_b)  # the reference: the rewrite is value-preserving
    ort_a, ort_b = _ort(m).run(None, {"x": x})[0], _ort(low).run(None, {"x": x})[0]
    np.testing.assert_array_equal(ort_a, ort_b)  # ORT: symmetric conv kernel vs im2col + QGEMM, same bytes
    # and ORT agrees with the reference within one output step (requantize rounding)
    assert np.abs(ort_b - ref_b).max() <= 0.2 + 1e-6


def test_only_the_symmetric_kernels_nodes_are_eligible():
    assert {n.name for n in eligible_convs(_conv_graph())} == {"conv3", "conv1"}
    assert {n.name for n in eligible_convs(_conv_graph(wzp=3))} == {"conv1"}  # nonzero weight zero point
    assert {n.name for n in eligible_convs(_conv_graph(group=2))} == {"conv1"}  # grouped
    assert {n.name for n in eligible_convs(_conv_graph(const_zp=False))} == {"conv1"}  # zero point not constant
    m = _conv_graph()
    assert lower(m, {"conv1"}) == {"lowered": 1, "kept": 1, "foldable": False}
    # a graph without a dynamic dimension: the chain folds back to a constant (ORT runs it as before)
    assert lower(_conv_graph(batch=2))["foldable"] is True


@pytest.mark.parametrize("flags, family", [(AMX, "amx"), (VNNI, "vnni"), (frozenset({"avx2", "avx_vnni"}), "vnni"),
                                           (AVX2, "portable"), (frozenset(), "portable")])
def test_int8_family_from_flags(flags, family, monkeypatch):
    monkeypatch.setattr(features, "cpu_flags", lambda: flags)
    assert features.int8_family() == family
    assert features.isa_summary()["int8_kernels"] == family


def _fake_measure(times):
    calls = []

    def measure(model, names):
        calls.append(set(names))
        return {n: times[n] for n in names}
    return measure, calls


def test_choice_per_cpu_with_faked_features(monkeypatch):
    m = _conv_graph()
    measure, calls = _fake_measure({"conv3": (2e-3, 1e-3), "conv1": (1e-3, 0.95e-3)})  # conv1: within the margin
    monkeypatch.setattr(features, "cpu_flags", lambda: AMX)
    chosen, rec = plan_kernels("auto", m, measure)
    assert chosen == {"conv3"} and rec["target"] == "amx" and rec["lowered"] == 1 and calls == [{"conv3", "conv1"}]
    assert rec["cpu"]["int8_kernels"] == "amx" and "amx_int8" in rec["cpu"]["isa_flags"]
    measure2, _ = _fake_measure({"conv3": (1e-4, 1e-5), "conv1": (1e-3, 1e-4)})  # conv3: too short to time
    assert plan_kernels("auto", m, measure2)[0] == {"conv1"}
    chosen, rec = plan_kernels("amx", m)
    assert chosen == {"conv3", "conv1"} and rec["target"] == "amx"
    for kernels in ("vnni", "portable"):
        assert plan_kernels(kernels, m)[0] == set()
    monkeypatch.setattr(features, "cpu_flags", lambda: VNNI)
    calls.clear()
    chosen, rec = plan_kernels("auto", m, measure)
    assert chosen == set() and rec["target"] == "any" and calls == []  # no AMX: today's graph, nothing timed
    with pytest.raises(UserError, match="no AMX"):
        plan_kernels("amx", m)
    with pytest.raises(ValueError, match="kernels must be one of"):
        plan_kernels("fast", m)


def test_load_warning_names_the_other_cpu(monkeypatch):
    monkeypatch.setattr(features, "cpu_flags", lambda: AMX)
    _, rec = plan_kernels("amx", _conv_graph())
    assert check.kernels_warning(rec) is None  # same family here
    assert check.kernels_warning({"target": "any"}) is None and check.kernels_warning(None) is None
    monkeypatch.setattr(features, "cpu_flags", lambda: VNNI)
    note = check.kernels_warning(rec)
    assert "laid out for amx" in note and "vnni" in note and "\n" not in note


def test_recipe_option_and_legacy_dicts():
    assert Int8StaticRecipe().kernels == "auto"
    with pytest.raises(UserError, match="kernels"):
        Int8StaticRecipe(kernels="fast")
    with pytest.raises(UserError, match="stored=cpu-fused"):
        Int8StaticRecipe(kernels="amx", stored="qdq")
    old = Int8StaticRecipe().to_dict()
    old.pop("kernels")
    old["version"] = 6
    assert recipe_from_dict(old).kernels == "portable"  # folders quantized before the option: today's graph


@pytest.mark.slow  # 7-13 s each: the whole suite (make test) runs it, test-fast does not
def test_quantize_lays_out_convs_and_images_match_portable(tiny_onnx, tmp_path, monkeypatch):
    """int8-static with kernels=auto on a (faked) AMX CPU: convs measured and lowered, recorded in the
    manifest; the images are the portable folder's, and a CPU without AMX gets one warning at load."""
    import json
    import warnings

    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.runtime import Pipeline

    fast = dict(calibration=CalibrationConfig(count=4, steps=2, batch=4), latency_runs=1, measure_memory=False)
    quantize(tiny_onnx, tmp_path / "portable", QuantizeConfig(recipe=Int8StaticRecipe(kernels="portable"), **fast),
             measure_quality=False)
    monkeypatch.setattr(features, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(int8_lowering, "AUTO_MARGIN", 1e9)  # every measured node counts as faster,
    monkeypatch.setattr(int8_lowering, "AUTO_MIN_S", 0.0)  # however short (the tiny UNet's convs are µs)
    quantize(tiny_onnx, tmp_path / "auto", QuantizeConfig(recipe=Int8StaticRecipe(kernels="auto"), **fast),
             measure_quality=False)
    rec = json.loads((tmp_path / "auto" / "manifest.json").read_text())["components"]["unet"]["int8_kernels"]
    assert rec["target"] == "amx" and rec["lowered"] == rec["eligible"] > 0 and rec["sym_ms"] > 0
    assert "int8_kernels" not in json.loads((tmp_path / "portable" / "manifest.json").read_text())["components"]["unet"]
    gen = dict(steps=3, guidance=4.0, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same family here: no warning
        a = Pipeline.from_folder(tmp_path / "auto", threads=1)(["a red circle"], **gen).images
    b = Pipeline.from_folder(tmp_path / "portable", threads=1)(["a red circle"], **gen).images
    np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(features, "cpu_flags", lambda: VNNI)
    with pytest.warns(UserWarning, match="laid out for amx kernels"):
        c = Pipeline.from_folder(tmp_path / "auto", threads=1)(["a red circle"], **gen).images
    np.testing.assert_array_equal(a, c)
