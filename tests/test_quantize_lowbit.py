"""fp8 and nvfp4 recipes end to end on the tiny pipeline: stored forms, manifest, measured quality."""

import json

import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize import CalibrationConfig, Fp8Recipe, Nvfp4Recipe, QuantizeConfig, quantize
from onnxdiffusion.quantize.graphs import op_counts
from onnxdiffusion.runtime import Pipeline

CAL = CalibrationConfig(count=4, steps=4, batch=4)
PROMPTS = ["a red circle on the left", "a blue star at the top"]
GEN = dict(steps=4, guidance=4.0, seed=1, batch=2)


def config(recipe):
    return QuantizeConfig(recipe=recipe, calibration=CAL, latency_runs=2, measure_memory=False)


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    return Pipeline.from_folder(tiny_onnx)(PROMPTS, **GEN)


def test_fp8_folder_runs_on_cpu_as_simulation(tiny_onnx, tmp_path, reference):
    out = tmp_path / "fp8"
    report = quantize(tiny_onnx, out, config(Fp8Recipe()))
    assert "float simulation" in report["verdict"] and report["latency"]
    unet = onnx.load(str(out / "unet" / "model.onnx"))
    onnx.checker.check_model(unet, full_check=True)
    assert any(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in unet.graph.initializer)
    assert report["quality"]["probe_psnr_db"] > 25
    images = Pipeline.from_folder(out)(PROMPTS, **GEN).images
    assert psnr(images, reference.images) > 25
    # ORT 1.31's QDQ selector rewrites FP8 DQ -> MatMul into MatMulIntegerToFloat and the session fails
    # to build (seen on the lent GPU machine): FP8 backbones run with that selector off
    from onnxdiffusion.quantize.runner import disabled_for
    assert "QDQSelectorActionTransformer" in disabled_for(unet)
    assert "QDQSelectorActionTransformer" not in disabled_for(onnx.load(str(tiny_onnx / "unet" / "model.onnx")))


@pytest.mark.parametrize("activations", ["fp16", "fp8"])
def test_nvfp4_portable_folder_measured_through_its_simulation(activations, tiny_onnx, tmp_path):
    out = tmp_path / activations
    report = quantize(tiny_onnx, out, config(Nvfp4Recipe(activations=activations)))
    assert report["latency"] == {} and report["latency_ratio"] is None and not report["pays"]
    assert "simulation" in report["quality"]["measured_on"]
    assert report["quality"]["probe_psnr_db"] > 15
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["components"]["unet"]["requires_provider"] == "tensorrt"
    assert manifest["quantization"]["config"]["recipe"]["activations"] == activations
    unet = onnx.load(str(out / "unet" / "model.onnx"))
    onnx.checker.check_model(unet, full_check=True)
    assert any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in unet.graph.initializer)


def test_nvfp4_tensorrt_form_with_dynamic_fp4_activations(tiny_onnx, tmp_path):
    out = tmp_path / "trt"
    report = quantize(tiny_onnx, out, config(Nvfp4Recipe(activations="fp4", form="tensorrt")))
    assert report["quality"] == {}  # nothing here runs TRT_FP4DynamicQuantize
    counts = op_counts(onnx.load(str(out / "unet" / "model.onnx")))
    # one dynamic quantizer per activation tensor, shared by its readers (q, k and v read one input)
    assert 0 < counts["TRT_FP4DynamicQuantize"] <= report["quantized_node_count"]
    assert counts["DequantizeLinear"] == 2 * counts["TRT_FP4DynamicQuantize"] + 2 * report["quantized_node_count"]


@pytest.mark.parametrize("make, fragment", [
    (lambda: Nvfp4Recipe(activations="fp4"), "form=tensorrt"),
    (lambda: Nvfp4Recipe(activations="fp4", form="tensorrt", op_types=("Conv",)), "not for Conv"),
    (lambda: Fp8Recipe(opset=17), "opset 19..23"),
    (lambda: Nvfp4Recipe(activations="int3"), "activations"),
])
def test_bad_lowbit_recipes(make, fragment):
    with pytest.raises(UserError, match=fragment):
        make()
