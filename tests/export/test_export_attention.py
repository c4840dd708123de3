"""Attention exported as ONNX Runtime's fused MultiHeadAttention, and the int8 bias fold."""

import pytest

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import run_cli_here  # the verb in-process: no interpreter and torch import of its own
from onnxdiffusion.folder.artifacts import read_manifest
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize.graphs import fold_matmul_bias
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow


def ops(folder, component):
    return Counter(n.op_type for n in onnx.load(str(folder / component / "model.onnx")).graph.node)


def test_every_diffusers_attention_becomes_one_fused_node(tiny_diffusers, tiny_onnx):
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import Attention

    unet = UNet2DConditionModel.from_pretrained(tiny_diffusers / "unet", local_files_only=True)
    expected = sum(isinstance(m, Attention) for m in unet.modules())
    assert expected > 0
    attention = read_manifest(tiny_onnx)["attention"]
    assert attention["fused"] and attention["modules"]["unet"] == expected
    unet_ops = ops(tiny_onnx, "unet")
    assert unet_ops["MultiHeadAttention"] == expected
    assert unet_ops["Softmax"] == 0
    assert ops(tiny_onnx, "vae_decoder")["MultiHeadAttention"] == 1  # the VAE mid-block (GroupNorm + residual)


def test_unfused_export_is_plain_onnx_and_gives_the_same_images(tiny_diffusers, tiny_onnx, tmp_path):
    out = tmp_path / "plain"
    proc = run_cli_here("export", tiny_diffusers, out, "--no-fuse-attention")
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(out)["attention"] == {"fused": False}
    for component in ("unet", "vae_decoder"):
        counts = ops(out, component)
        assert counts["MultiHeadAttention"] == 0 and counts["Softmax"] > 0
        model = onnx.load(str(out / component / "model.onnx"))
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    kw = dict(steps=4, seed=3, guidance=5.0)
    fused = Pipeline.from_folder(tiny_onnx)("a blue star above a red square", **kw).images
    plain = Pipeline.from_folder(out)("a blue star above a red square", **kw).images
    assert psnr(plain, fused) > 50


def test_unsupported_attention_keeps_its_processor():
    import torch
    from diffusers.models.attention_processor import Attention

    from onnxdiffusion.export.attention import FusedAttnProcessor, fuse_attention

    plain = Attention(query_dim=16, heads=2, dim_head=8)
    normed = Attention(query_dim=16, heads=2, dim_head=8, qk_norm="layer_norm")
    grouped = Attention(query_dim=16, heads=4, dim_head=4, kv_heads=2)
    module = torch.nn.ModuleList([plain, normed, grouped])
    assert fuse_attention(module) == 1
    assert isinstance(plain.processor, FusedAttnProcessor)
    assert not isinstance(normed.processor, FusedAttnProcessor)
    assert not isinstance(grouped.processor, FusedAttnProcessor)


def _matmul_int_to_float(readers_of_product: int = 1):
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, size=(8, 6), dtype=np.int8)
    bias = rng.standard_normal(6).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.02, np.float32), "a_scale"),
        numpy_helper.from_array(np.full(6, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "a_zp"), numpy_helper.from_array(bias, "bias"),
    ]
    nodes = [
        helper.make_node("MatMulIntegerToFloat", ["a", "w", "a_scale", "w_scale", "a_zp"], ["mm"], domain="com.microsoft"),
        helper.make_node("Add", ["bias", "mm"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if readers_of_product > 1:
        nodes.append(helper.make_node("Relu", ["mm"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 3, 8])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _run(model, a):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})


def test_bias_folds_into_matmul_integer_to_float():
    model = _matmul_int_to_float()
    a = np.random.default_rng(1).integers(0, 256, size=(2, 3, 8), dtype=np.uint8)
    before = _run(model, a)[0]
    assert fold_matmul_bias(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMulIntegerToFloat"]
    assert model.graph.node[0].input[6] == "bias" and model.graph.node[0].output[0] == "y"
    np.testing.assert_allclose(_run(model, a)[0], before, rtol=1e-6, atol=1e-5)


def test_bias_fold_leaves_a_shared_product_alone():
    model = _matmul_int_to_float(readers_of_product=2)
    assert fold_matmul_bias(model) == 0
    assert Counter(n.op_type for n in model.graph.node)["Add"] == 1
