"""Big models: external data merged into one file inside the component folder."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiffusion.export.external_data import consolidate, external_files

pytestmark = pytest.mark.slow


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


def test_export_lets_go_of_the_torch_weights_before_onnx_runtime_loads(tiny_diffusers, tmp_path, monkeypatch):
    """Export peak memory: a source's torch module is released before its last component is validated
    (the VAE's decoder is validated while the encoder still needs the module; the encoder after release)."""
    import weakref

    import onnxdiffusion.export.pipeline as P
    import onnxdiffusion.export.validate as V

    loaded, alive = [], []
    real_load, real_session = P._load, V._validation_session
    monkeypatch.setattr(P, "_load", lambda *a: loaded.append(weakref.ref(m := real_load(*a))) or m)
    monkeypatch.setattr(V, "_validation_session", lambda path: alive.append(loaded[-1]() is not None) or real_session(path))
    manifest = P.export_pipeline(tiny_diffusers, tmp_path / "out", P.ExportOptions(components=("unet", "vae_decoder", "vae_encoder")),
                                 progress=False)
    assert alive == [False, True, False]
    assert all(manifest["components"][c]["validation"]["max_abs_error"] < 1e-3 for c in ("unet", "vae_decoder"))


def test_consolidate_leaves_a_model_without_external_data_alone(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")])
    path = tmp_path / "model.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    before = path.read_bytes()
    monkeypatch.setattr(onnx, "load", lambda *a, **k: pytest.fail("a model with nothing beside it was parsed"))
    consolidate(path)
    assert path.read_bytes() == before and external_files.__module__
