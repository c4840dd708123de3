"""quantize/_ort.py's speed-ups of ONNX Runtime's QDQ quantizer (a consumer index behind its input rewiring, weight
channels' scales and integers remembered across builds) write the bytes ORT's own quantizer writes."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from onnxdiffusion.onnxio import files
from onnxdiffusion.quantize import _ort, _ort_fast
from onnxdiffusion.quantize.graphs import prepare_unet, quantizable_nodes

ROOT = Path(__file__).resolve().parents[2]
BACKBONES = {"sd": ROOT / "models" / "shapes-sd-onnx" / "unet" / "model.onnx",
             "mmdit": ROOT / "models" / "shapes-mmdit-onnx" / "transformer" / "model.onnx"}
OPS = ("Conv", "MatMul", "Gemm")


def _case(name: str, every: int):
    model = prepare_unet(files.load_backbone(BACKBONES[name]))
    nodes = [q.name for q in quantizable_nodes(model, OPS)][::every]
    assert len(nodes) > 10  # (an empty list would mean every node to ORT)
    # any ranges will do (the quantizer writes what it is given); varied, so that no two tensors share a scale
    names = [i.name for i in model.graph.input] + [o for n in model.graph.node for o in n.output]
    ranges = {t: (-1.0 - i / 97, 1.0 + i / 89) for i, t in enumerate(names)}
    return model, ranges, nodes


def _plain_ort(monkeypatch) -> None:
    from onnxruntime.quantization.onnx_model import ONNXModel

    monkeypatch.setattr(_ort, "consumer_indexed_model", lambda: ONNXModel)
    monkeypatch.setattr(_ort, "weights_remembered", contextlib.nullcontext)


@pytest.mark.parametrize("name, every, float_outputs", [("sd", 2, ("MatMul",)), ("mmdit", 1, ())])
def test_fast_quantizer_writes_ort_bytes(monkeypatch, name, every, float_outputs):
    model, ranges, nodes = _case(name, every)
    _ort_fast._CHANNEL_PARAMS.clear()
    _ort_fast._QUANTIZED.clear()
    fast = [_ort.qdq_quantize(model, ranges, nodes, OPS, float_outputs=float_outputs).SerializeToString()
            for _ in range(2)]  # the second build takes every weight's scales and integers from the tables
    assert _ort_fast._CHANNEL_PARAMS and _ort_fast._QUANTIZED
    _plain_ort(monkeypatch)
    plain = _ort.qdq_quantize(model, ranges, nodes, OPS, float_outputs=float_outputs).SerializeToString()
    assert fast[0] == plain
    assert fast[1] == plain


def test_consumer_index_follows_edits_made_around_it():
    """Inputs rewired by the model's other methods and removed nodes drop the index; appended nodes join it."""
    from onnx import helper

    cls = _ort_fast.consumer_indexed_model()
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["a"], name="r1"),
                               helper.make_node("Add", ["a", "x"], ["b"], name="add"),
                               helper.make_node("Relu", ["x"], ["c"], name="r2")], "g", [], [])
    m = cls(helper.make_model(graph))
    nodes = m.model.graph.node
    m.replace_input_of_all_nodes("x", "x1")
    assert [list(n.input) for n in nodes] == [["x1"], ["a", "x1"], ["x1"]]
    m.replace_input_of_nodes("x1", "y", {"add"})  # not through the index
    m.replace_input_of_all_nodes("y", "y1")
    assert list(nodes[1].input) == ["a", "y1"]
    m.remove_node(nodes[0])
    m.add_node(helper.make_node("Neg", ["x1"], ["d"], name="neg"))  # appended after the removal
    m.replace_input_of_all_nodes("x1", "z")
    assert [list(n.input) for n in nodes] == [["a", "y1"], ["z"], ["z"]]
