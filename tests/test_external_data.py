"""Big models: external data merged into one file inside the component folder."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiffusion.export.external_data import consolidate, external_files


def _model(tmp_path):
    rng = np.random.default_rng(0)
    w = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(3)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"]) for i in range(3)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("h3", TensorProto.FLOAT, [1, 16])],
        initializer=[onnx.numpy_helper.from_array(a, f"w{i}") for i, a in enumerate(w)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model.onnx"
    # one file per tensor, as the TorchScript exporter writes them past 2 GB
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    return path


def test_consolidate_merges_per_tensor_files(tmp_path):
    path = _model(tmp_path)
    x = np.ones((1, 16), np.float32)
    before = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert len(external_files(path)) == 3
    consolidate(path)
    assert external_files(path) == ["model.onnx_data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx_data"]
    after = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(before, after)


def test_external_data_outside_the_folder_is_refused(tmp_path):
    path = _model(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    entry = next(e for e in model.graph.initializer[0].external_data if e.key == "location")
    entry.value = "../outside.bin"
    onnx.save(model, str(path))
    with pytest.raises(ValueError, match="outside"):
        consolidate(path)


def test_runtime_refuses_external_data_outside_the_folder(tmp_path):
    from onnxdiffusion.errors import UserError
    from onnxdiffusion.runtime.session import make_session

    path = _model(tmp_path)
    consolidate(path)
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../etc/passwd"
    onnx.save(model, str(path))
    with pytest.raises(UserError, match="outside"):
        make_session(path)
