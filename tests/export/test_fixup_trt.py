"""fixup-trt on files that reproduce NVIDIA Model Optimizer's export pattern, built here."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.export.fixup_trt import annotate_trt_types, fixup_trt, upgrade
from onnxdiffusion.quantize.graphs import quantizable_nodes
from onnxdiffusion.quantize.lowbit_graphs import TRT_OUTPUT_TYPES, nvfp4_graph
from onnxdiffusion.quantize.recipes import prepare_unet


def modelopt_export(unet: onnx.ModelProto, opset: int = 21) -> onnx.ModelProto:
    """Our TensorRT form as Model Optimizer leaves it before the hand fix-up: default opset below 23
    (FLOAT4E2M1 tensors then break type checks), no value_info for the trt ops' outputs."""
    unet = prepare_unet(unet)
    nodes = [q.name for q in quantizable_nodes(unet, ("MatMul", "Gemm"))]
    inputs = {n.input[0] for n in unet.graph.node if n.name in set(nodes)}
    ranges = {x: (-4.0, 4.0) for x in inputs}
    m = nvfp4_graph(unet, nodes, "fp4", ranges, form="tensorrt")
    for o in m.opset_import:
        if o.domain == "":
            o.version = opset
    trt_outputs = {o for n in m.graph.node if n.domain == "trt" for o in n.output}
    keep = [v for v in m.graph.value_info if v.name not in trt_outputs]
    del m.graph.value_info[:]
    m.graph.value_info.extend(keep)
    return m


@pytest.fixture()
def folder(tiny_onnx, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_onnx, dst)
    return dst


@pytest.fixture()
def exported(tiny_onnx, tmp_path):
    """Saved the way the exporter saves big models: one external file per weight."""
    m = modelopt_export(onnx.load(str(tiny_onnx / "unet" / "model.onnx")))
    d = tmp_path / "modelopt"
    d.mkdir()
    onnx.save_model(m, str(d / "unet.onnx"), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    assert len(list(d.iterdir())) > 10
    return d / "unet.onnx"


def test_the_raw_export_fails_the_checker(exported):
    with pytest.raises(Exception):
        onnx.checker.check_model(str(exported), full_check=True)


def test_fixup_types_every_trt_output_and_passes_the_checker(exported, folder):
    entry = fixup_trt(exported, folder)
    path = folder / entry["path"]
    onnx.checker.check_model(str(path), full_check=True)
    m = onnx.load(str(path))
    assert {o.domain: o.version for o in m.opset_import}[""] == 23
    vi = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    trt = [n for n in m.graph.node if n.domain == "trt"]
    assert trt and all(tuple(vi[o] for o in n.output) == TRT_OUTPUT_TYPES[n.op_type] for n in trt)
    assert {p.name for p in path.parent.iterdir()} - {"config.json"} == {"model.onnx", "model.onnx_data"}
    manifest = json.loads((folder / "manifest.json").read_text())
    unet = manifest["components"]["unet"]
    assert unet["precision"] == "nvfp4" and unet["requires_provider"] == "tensorrt"
    assert unet["installed_by"]["opset"]["to"] == 23
    assert unet["installed_by"]["trt_outputs_typed"] == sum(len(n.output) for n in trt)
    assert (folder / unet["fallback"]["path"]).is_file()
    from onnxdiffusion.folder.artifacts import verify_folder

    verify_folder(folder, manifest)  # hashes written for every file, old backbone kept as fallback


def test_upgrade_reports_what_the_converter_could_not_do():
    # an opset-18 graph: a GroupNormalization-18 (per-group scale/bias) and FP4 data the converter rejects
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1])
    scale = numpy_helper.from_array(np.float32([1, 2]), "s")
    bias = numpy_helper.from_array(np.float32([0, 1]), "b")
    w4 = helper.make_tensor("w4", TensorProto.FLOAT4E2M1, [4], [1.0, 2.0, 3.0, 4.0])
    g = helper.make_graph(
        [helper.make_node("GroupNormalization", ["x", "s", "b"], ["n"], num_groups=2, name="gn"),
         helper.make_node("ReduceMean", ["n", "axes"], ["r"], keepdims=1, name="rm"),
         helper.make_node("DequantizeLinear", ["w4", "one"], ["w"], name="dq"),
         helper.make_node("Reshape", ["w", "shape"], ["w2"]),
         helper.make_node("Add", ["r", "w2"], ["y"])],
        "g", [x], [y], [scale, bias, w4, numpy_helper.from_array(np.float32(1), "one"),
                        numpy_helper.from_array(np.int64([1, 4, 1, 1]), "shape"),
                        numpy_helper.from_array(np.int64([2, 3]), "axes")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.graph.value_info.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2]))
    fixed, info = upgrade(m)
    assert info["to"] == 23
    assert any("GroupNormalization" in a for a in info["adapted"])  # the converter alone leaves it per-group
    onnx.checker.check_model(fixed, full_check=True)
    from onnx.reference import ReferenceEvaluator

    xv = np.arange(16, dtype=np.float32).reshape(1, 4, 2, 2)
    out = ReferenceEvaluator(fixed).run(None, {"x": xv})[0]
    g = xv.reshape(1, 2, 8)
    norm = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(1, 4, 2, 2)
    want = (norm * np.float32([1, 1, 2, 2])[:, None, None] + np.float32([0, 0, 1, 1])[:, None, None]).mean((2, 3))
    assert np.allclose(out.ravel(), want.ravel() + np.float32([1, 2, 3, 4]), atol=1e-4)


def test_unknown_trt_op_is_one_line_error():
    g = helper.make_graph([helper.make_node("TRT_Mystery", ["x"], ["y"], domain="trt")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)])
    with pytest.raises(UserError, match="TRT_Mystery"):
        annotate_trt_types(m)


def test_fixup_refuses_a_missing_input_and_leaves_the_folder(folder, tmp_path):
    before = (folder / "manifest.json").read_text()
    with pytest.raises(UserError, match="not found"):
        fixup_trt(tmp_path / "nope.onnx", folder)
    assert (folder / "manifest.json").read_text() == before
