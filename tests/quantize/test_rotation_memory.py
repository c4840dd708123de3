"""rotate_linears never copies the weights it replaces, reads them from external data, and leaves its input alone."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.onnxio.files import DATA_DIR_KEY
from onnxdiffusion.quantize.rotation import rotate_linears

K, N = 64, 32


def _model(rng) -> onnx.ModelProto:
    """Two linears on x: `a` (rotated) and `b` (not named) share the weight w; `c` has its own v."""
    w = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w")
    v = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "v")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["ya"], name="a"), helper.make_node("MatMul", ["x", "w"], ["yb"], name="b"),
             helper.make_node("MatMul", ["x", "v"], ["yc"], name="c")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [4, N]) for y in ("ya", "yb", "yc")], [w, v])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_input_is_unchanged_and_only_dead_weights_are_dropped():
    model = _model(np.random.default_rng(0))
    before = model.SerializeToString()
    out, counts = rotate_linears(model, ["a", "c"], 64)
    assert model.SerializeToString() == before
    names = [t.name for t in out.graph.initializer]
    assert "w" in names and "v" not in names  # w is still read by b (not rotated); v only by c
    assert names[-2:] == ["a/rotated_weight", "c/rotated_weight"] and counts["linears"] == 2


def test_weights_in_external_data_are_read_from_there(tmp_path):
    model = _model(np.random.default_rng(1))
    inline, _ = rotate_linears(model, ["a", "c"], 64)
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx_data", size_threshold=0)
    skeleton = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    skeleton.metadata_props.add(key=DATA_DIR_KEY, value=str(tmp_path))
    out, _ = rotate_linears(skeleton, ["a", "c"], 64)
    got = {t.name: t for t in out.graph.initializer}
    for t in inline.graph.initializer:
        if t.name.endswith("/rotated_weight"):
            np.testing.assert_array_equal(numpy_helper.to_array(got[t.name]), numpy_helper.to_array(t))
    assert got["w"].data_location == TensorProto.EXTERNAL and "v" not in got
