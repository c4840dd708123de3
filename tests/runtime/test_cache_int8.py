"""Step caching on an int8-static backbone: a quantized folder's graph is saved after ONNX Runtime's optimizer
(QLinearConv, QGemm, MatMulIntegerToFloat ..., unnamed Q/DQ nodes, tensors renamed), so the cut must type the
uint8 tensors it passes between its pieces and keep the integer kernels inside the span."""

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.families import get_family
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.backbone_split import run_whole, split

PROMPT = "a red circle on the left"


def _session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _qconv(name: str, x: str, y: str, w: np.ndarray, inits: list) -> onnx.NodeProto:
    inits += [numpy_helper.from_array(w, f"{name}.w"), numpy_helper.from_array(np.array(0.05, np.float32), f"{name}.ws"),
              numpy_helper.from_array(np.array(0, np.int8), f"{name}.wz")]
    return helper.make_node("QLinearConv", [x, "s", "z", f"{name}.w", f"{name}.ws", f"{name}.wz", "s", "z"], [y],
                            name=f"/model/{name}/Conv", pads=[1, 1, 1, 1])


def test_uint8_tensors_between_the_pieces_are_typed():
    _toy_cut()


def _toy_cut():
    """A contrib integer op (QLinearAdd) ahead of the span leaves ONNX's shape inference with no types
    downstream: the cut still types the uint8 tensor it passes from `first` to `rest` (it used to fall back to
    float, and ONNX Runtime refused the piece)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s"), numpy_helper.from_array(np.array(128, np.uint8), "z")]
    w = [rng.integers(-20, 20, (4, 4, 3, 3), dtype=np.int8) for _ in range(2)]
    nodes = [helper.make_node("QuantizeLinear", ["sample", "s", "z"], ["q"]),
             helper.make_node("QLinearAdd", ["q", "s", "z", "q", "s", "z", "s", "z"], ["a"], domain="com.microsoft",
                              name="/model/down_blocks.0/Add"),
             _qconv("mid_block", "a", "b", w[0], inits), _qconv("up_blocks.0", "b", "c", w[1], inits),
             helper.make_node("DequantizeLinear", ["c", "s", "z"], ["out"])]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sg = split(model, ("/model/mid_block/",))
    assert sg.span_inputs == ["a"] and sg.span_outputs == ["b"]
    assert [o.type.tensor_type.elem_type for o in sg.first.graph.output] == [TensorProto.UINT8]
    feeds = {"sample": rng.standard_normal((1, 4, 8, 8), dtype=np.float32)}
    want = _session(model).run(None, feeds)[0]
    got = run_whole(_session(sg.first), _session(sg.rest), _session(sg.tail), sg, feeds)
    assert np.array_equal(got, want)
    return model, sg, feeds, want


def test_a_piece_over_the_inline_limit_goes_through_a_file(monkeypatch):
    """A full-size UNet's span is over protobuf's 2 GiB: its session is made from a temporary file with external
    data (the limit lowered here so a tiny piece takes that path); the pieces compute the same."""
    from onnxdiffusion.techniques import caching as cache

    model, sg, feeds, want = _toy_cut()
    monkeypatch.setattr(cache, "INLINE_LIMIT", 0)
    made = []

    def make(b):
        made.append(type(b))
        return ort.InferenceSession(b, providers=["CPUExecutionProvider"])

    first, rest, tail = (cache.piece_session(m, make) for m in (sg.first, sg.rest, sg.tail))
    assert made == [str, str, str]
    assert np.array_equal(run_whole(first, rest, tail, sg, feeds), want)


# --- on quantized tiny folders (slow: quantize with calibration) ------------------------------------

@pytest.fixture(scope="module")
def int8_folders(tiny_int8_static, tiny_sd3_int8_static):
    """conftest's shared int8-static folders (this module's own quantizations before, the same configs: 4 x 3
    calibration, DDIM on SD, flow_euler on SD3)."""
    return {"sd": tiny_int8_static, "sd3": tiny_sd3_int8_static}


def _integer_ops(m: onnx.ModelProto) -> int:
    c = collections.Counter(n.op_type for n in m.graph.node)
    return sum(v for k, v in c.items() if k.startswith("QLinear") or k in ("QGemm", "MatMulIntegerToFloat"))


@pytest.mark.slow
@pytest.mark.parametrize("name,method,layers", [("sd", "deepcache", 0), ("sd", "deepcache", 1), ("sd3", "first_block", 0)])
def test_cut_int8_backbone_is_the_whole_graph(int8_folders, name, method, layers):
    folder = int8_folders[name]
    manifest = json.loads((folder / "manifest.json").read_text())
    family = get_family(manifest["family"])
    model = onnx.load(str(folder / manifest["components"][family.backbone]["path"]))
    span, probe = family.cache_span(method, [n.name for n in model.graph.node], **({"layers": layers} if layers else {}))
    sg = split(model, span, probe)
    assert len(sg.span_outputs) == 1
    # the integer kernels stay integer: every one lands in a piece, the span holds some
    assert _integer_ops(sg.rest) > 0
    assert _integer_ops(sg.first) + _integer_ops(sg.rest) + _integer_ops(sg.tail) >= _integer_ops(model)
    whole = _session(model)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in whole.get_inputs():
        shape = [2 if d == "batch_size" else 8 if isinstance(d, str) or d is None else d for d in i.shape]
        feeds[i.name] = (np.full(shape, 500.0, np.float32) if i.name == "timestep"
                         else rng.standard_normal(shape, dtype=np.float32))
    want = whole.run(None, feeds)[0]
    got = run_whole(_session(sg.first), _session(sg.rest), _session(sg.tail), sg, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("name,spec", [("sd", "deepcache:2"), ("sd", "deepcache:2:L1"), ("sd3", "first_block:0.3"),
                                       ("sd3", "taylorseer:2"),
                                       ("sd3", "taylorseer:2:2")])
def test_cache_runs_on_int8_and_noop_is_identical(int8_folders, name, spec):
    pipe = Pipeline.from_folder(int8_folders[name], verify=False)
    kw = dict(steps=8, seed=3) if name == "sd" else dict(steps=8, seed=3, height=32, width=32)
    base = pipe(PROMPT, **kw).images
    cached = pipe(PROMPT, **kw, cache=spec).images
    assert np.isfinite(cached).all() and psnr(cached, base) > 10
    noop = {"deepcache": "deepcache:1", "first_block": "first_block:0", "taylorseer": "taylorseer:1"}[spec.split(":")[0]]
    assert np.array_equal(pipe(PROMPT, **kw, cache=noop).images, base)


@pytest.mark.slow
@pytest.mark.parametrize("name,spec", [("sd", "deepcache:2"), ("sd", "deepcache:3:L1"), ("sd3", "taylorseer:2")])
def test_loop_graph_cache_on_int8_is_the_host_loop(int8_folders, name, spec, tmp_path):
    """compile-loop --cache on an int8-static folder: DeepCache carries the UNet's quantized (uint8) deep feature
    (it used to be declared float and the Loop graph failed to load); same images as the host loop."""
    from onnxdiffusion.loopgraph.compile import compile_loop

    out = tmp_path / "loop"
    compile_loop(int8_folders[name], out, form="loop", cache=spec)  # (the interval is chosen per run)
    pipe = Pipeline.from_folder(out, verify=False)
    kw = dict(steps=6, seed=4) if name == "sd" else dict(steps=6, seed=4, height=32, width=32)
    host = pipe(PROMPT, **kw, cache=spec).images
    assert np.array_equal(pipe(PROMPT, **kw, cache=spec, loop="loop").images, host)
