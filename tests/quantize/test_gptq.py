"""quantize/gptq.py: GPTQ with per-block clip search, packed as ONNX Runtime's MatMulNBits (int4-weights /
w4a8 `algorithm=gptq-clip`)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.quantize import Int4WeightsRecipe, gptq, recipe_class, recipe_from_dict

F = onnx.TensorProto.FLOAT


def _ort_quantized(w: np.ndarray, block: int, symmetric: bool, quantizer=None) -> tuple[list, dict]:
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    holder = onnx.GraphProto()
    holder.initializer.append(numpy_helper.from_array(w, "w"))
    quantizer = quantizer or nbits.DefaultWeightOnlyQuantizer(nbits.DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=symmetric, accuracy_level=None, op_types_to_quantize=("MatMul",), bits=4))
    made = quantizer.quantize(node, [holder])
    return made, {t.name: t for t in holder.initializer if t.name != "w"}


def _run(made, inits, x, n):
    graph = helper.make_graph(made, "g", [helper.make_tensor_value_info("x", F, list(x.shape))],
                              [helper.make_tensor_value_info("y", F, [x.shape[0], n])], list(inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _dequantized(q, scales, zps, block):
    k = q.shape[0]
    return (q - np.repeat(zps, block, 0)[:k]) * np.repeat(scales, block, 0)[:k]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [160, 64])  # 160 / 32: an odd number of blocks, the zero points' last byte half empty
def test_packing_is_ort_own_layout(symmetric, k, monkeypatch):
    # with one clip ratio (1.0) and no error feedback (identity Hessian, no damping) it is min/max rounding: ORT's bytes
    w = np.random.default_rng(0).standard_normal((k, 8)).astype(np.float32)
    _, ref = _ort_quantized(w, 32, symmetric)
    monkeypatch.setattr(gptq, "CLIP_GRID", (1.0,))
    packed, scales, zps = gptq.pack(*gptq.gptq_blocks(w, np.eye(k), 32, symmetric, damp=0.0), 32)
    np.testing.assert_array_equal(packed, numpy_helper.to_array(ref["w_Q4"]))
    np.testing.assert_allclose(scales, numpy_helper.to_array(ref["w_scales"]), rtol=1e-6)
    if not symmetric:
        np.testing.assert_array_equal(zps, numpy_helper.to_array(ref["w_zero_points"]))


@pytest.mark.parametrize("symmetric", [False, True])
def test_matmulnbits_computes_the_numpy_twin_and_beats_rounding_to_nearest(symmetric):
    rng = np.random.default_rng(1)
    k, n, block = 96, 24, 32
    mix = rng.standard_normal((k, k)) * (rng.random(k) ** 3)  # correlated channels of unequal scale: GPTQ's case
    x = (rng.standard_normal((512, k)) @ mix).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    hessian = x.T.astype(np.float64) @ x / len(x)
    made, inits = _ort_quantized(w, block, symmetric, gptq.weight_quantizer({"x": hessian}, block, symmetric, 0))
    assert [m.op_type for m in made] == ["MatMulNBits"] and ("w_zero_points" in inits) == (not symmetric)
    got = _run(made, inits, x, n)
    twin = x @ _dequantized(*gptq.gptq_blocks(w, hessian, block, symmetric), block)
    np.testing.assert_allclose(got, twin, rtol=1e-4, atol=1e-4 * np.abs(twin).max())
    made_rtn, inits_rtn = _ort_quantized(w, block, symmetric)
    exact = x @ w
    err, err_rtn = (np.mean((_run(m, i, x, n) - exact) ** 2) for m, i in ((made, inits), (made_rtn, inits_rtn)))
    assert err < 0.8 * err_rtn  # 8 bits leave less to win than 4: ~1.4 dB here, ~3 dB on well-conditioned inputs
