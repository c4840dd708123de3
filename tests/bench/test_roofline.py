"""The roofline tool: FLOPs counted from a graph match a hand count, the GEMM kernels compute what they
claim, and the profile and achieved fraction come out for a real (tiny) backbone."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.bench import roofline


def test_gemm_microbenchmark_graphs_compute_the_product():
    n = 64
    rng = np.random.default_rng(0)
    for kind, a in (("fp32", rng.standard_normal((n, n), dtype=np.float32)),
                    ("int8", rng.integers(0, 256, (n, n), dtype=np.uint8))):
        blob = roofline._gemm_model(kind, n)
        b = numpy_helper.to_array(onnx.load_from_string(blob).graph.initializer[0])
        got = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]
        want = a @ b if kind == "fp32" else (a.astype(np.int32) - 128) @ b.astype(np.int32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_flops_are_counted_from_shapes(tmp_path):
    # Conv 3->8, 3x3, on 1x3x16x16 (pad 1) then MatMul (1,8,256,16)... flattened: (8*16, 16) x (16, 32)
    w = numpy_helper.from_array(np.zeros((8, 3, 3, 3), np.float32), "w")
    m = numpy_helper.from_array(np.zeros((16, 32), np.float32), "m")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("MatMul", ["c", "m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, m])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    got = roofline.count_flops(path, {"x": [2, 3, 16, 16]})
    conv = 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)
    matmul = 2 * (2 * 8 * 16 * 32) * 16
    assert got["by_op"] == {"Conv": conv, "MatMul": matmul} and got["total"] == conv + matmul
    # the same graph with its weights in an external file (how a >2 GB backbone is stored)
    ext = tmp_path / "ext" / "g.onnx"
    ext.parent.mkdir()
    onnx.save(onnx.load(path), ext, save_as_external_data=True, all_tensors_to_one_file=True, location="g.onnx_data",
              size_threshold=0)
    assert roofline.count_flops(ext, {"x": [2, 3, 16, 16]})["by_op"] == got["by_op"]


def test_measure_on_the_tiny_backbone(tiny_onnx):
    res = roofline.measure({"fp32": tiny_onnx}, threads=1, height=64, width=64, repeats=1,
                           progress=lambda m: None, gemm_n=256)
    assert res["flops_per_call"]["total"] > 0 and res["flops_per_call"]["nodes_without_shapes"] == 0
    assert "MultiHeadAttention" in res["flops_per_call"]["by_op"] or "MatMul" in res["flops_per_call"]["by_op"]
    row = res["variants"]["fp32"]
    assert 0 < row["fraction_of_peak"] and row["profile"]["ops"][0]["s"] > 0
    assert "| fp32 |" in roofline.to_markdown(res)


def test_first_folder_only_counts_flops(tiny_onnx, tmp_path):
    import shutil

    other = tmp_path / "copy"
    shutil.copytree(tiny_onnx, other)
    res = roofline.measure({"fp32": tiny_onnx, "copy": other}, threads=1, height=64, width=64, repeats=1,
                           progress=lambda m: None, gemm_n=256, time_first=False, profile=False)
    assert list(res["variants"]) == ["copy"] and res["flops_per_call"]["total"] > 0
