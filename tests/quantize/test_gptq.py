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
    assert err < 0.5 * err_rtn  # the output error, which GPTQ minimizes, at least 3 dB under min/max rounding


def test_a_dead_input_channel_is_left_out_and_padding_dequantizes_to_zero():
    w = np.random.default_rng(2).standard_normal((40, 4))
    hessian = np.eye(40)
    hessian[3, 3] = 0.0  # channel 3 never active
    q, scales, zps = gptq.gptq_blocks(w, hessian, 32, False)
    deq = _dequantized(q, scales, zps, 32)
    assert np.all(np.isfinite(deq)) and np.allclose(deq[3], 0, atol=np.abs(scales).max())
    packed, _, _ = gptq.pack(q, scales, zps, 32)
    assert packed.shape == (4, 2, 16)


def test_the_algorithm_is_a_recipe_option_recorded_and_calibrated():
    recipe = recipe_class("w4a8").with_options({"algorithm": "gptq-clip", "symmetric": "false"})
    assert recipe.calibrated and recipe_from_dict(recipe.to_dict()) == recipe
    assert recipe.to_dict()["algorithm"] == "gptq-clip" and recipe.to_dict()["symmetric"] is False
    assert Int4WeightsRecipe(algorithm="gptq-clip").calibrated
    with pytest.raises(UserError, match="algorithm must be one of"):
        recipe_class("w4a8").with_options({"algorithm": "gptq-mse"})


@pytest.mark.slow
def test_w4a8_gptq_clip_quantizes_the_tiny_pipeline(tiny_onnx, tmp_path):
    from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize
    from onnxdiffusion.runtime import Pipeline

    recipe = recipe_class("w4a8").with_options({"algorithm": "gptq-clip", "symmetric": "false", "block_size": "16"})
    cfg = QuantizeConfig(recipe=recipe, calibration=CalibrationConfig(count=4, steps=2), latency_runs=1, measure_memory=False)
    report = quantize(tiny_onnx, tmp_path / "q", cfg)
    assert report["details"]["algorithm"] == "gptq-clip" and report["details"]["gptq_timesteps"] == 2
    model = onnx.load(str(tmp_path / "q" / "unet" / "model.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 4 for n in nbits)  # zero points: asymmetric
    images = Pipeline.from_folder(tmp_path / "q")(["a red circle on the left"], steps=2, guidance=4.0, seed=1).images
    assert np.all(np.isfinite(images))


@pytest.mark.slow
def test_gptq_clip_refuses_a_backbone_past_the_inline_limit(tiny_onnx, monkeypatch):
    from onnxdiffusion.onnxio import files as onnxio_files
    from onnxdiffusion.quantize import files
    from onnxdiffusion.quantize.graphs import quantizable_nodes
    from onnxdiffusion.quantize.recipes import prepare_unet

    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", 64 << 10)
    sk = prepare_unet(files.load_backbone(tiny_onnx / "unet" / "model.onnx"))
    names = [q.name for q in quantizable_nodes(sk, ("MatMul",))]
    with pytest.raises(UserError, match="only backbones under 2 GB"):
        gptq.gptq_clip_quantize(sk, sk, names, None, Int4WeightsRecipe(algorithm="gptq-clip"))
