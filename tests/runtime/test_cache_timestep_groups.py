"""Step caching on a timestep-grouped backbone (int8-timestep: K group graphs behind If switches): each group's
branch is cut alike and each piece switches between its groups' cuts (runtime/backbone_groups.py); a quantized
span output is handed on as float so a feature cached in one group is read with the next group's scales."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.quantize.timestep_graphs import merge_timestep_groups
from onnxdiffusion.runtime.backbone_groups import split_groups, switches
from onnxdiffusion.runtime.backbone_split import run_whole

PROMPT = "a red circle on the left"
SPAN = (("/model/mid_block/",), None)


def _session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _group(k: float, scale: float, quantized: bool, named: bool = True) -> onnx.ModelProto:
    """sample * k -> (mid: + k, [quantized with `scale`]) -> (up: [dequantized] + the down output): one group."""
    def name(n: str) -> str:
        return n if named else ""

    inits = [numpy_helper.from_array(np.array(k, np.float32), "k"),
             numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    nodes = [helper.make_node("Mul", ["sample", "k"], ["a"], name=name("/model/down_blocks.0/Mul")),
             helper.make_node("Add", ["a", "k"], ["b"], name=name("/model/mid_block/Add"))]
    if quantized:
        nodes += [helper.make_node("QuantizeLinear", ["b", "s", "z"], ["bq"], name=name("/model/mid_block/Quant")),
                  helper.make_node("DequantizeLinear", ["bq", "s", "z"], ["c"], name=name("/model/up_blocks.0/Deq"))]
    else:
        nodes.append(helper.make_node("Identity", ["b"], ["c"], name=name("/model/up_blocks.0/Identity")))
    nodes.append(helper.make_node("Add", ["c", "a"], ["out_sample"], name=name("/model/up_blocks.0/Add")))
    ins = [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 2, 4, 4]),
           helper.make_tensor_value_info("timestep", TensorProto.FLOAT, [1]),
           helper.make_tensor_value_info("encoder_hidden_states", TensorProto.FLOAT, [1, 3, 4])]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("out_sample", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _grouped(quantized: bool, named: bool = True) -> onnx.ModelProto:
    return merge_timestep_groups([_group(2.0, 0.05, quantized, named), _group(3.0, 0.08, quantized, named)], [500.0])


def _feeds(t: float) -> dict:
    rng = np.random.default_rng(0)
    return {"sample": rng.standard_normal((1, 2, 4, 4), dtype=np.float32), "timestep": np.array([t], np.float32),
            "encoder_hidden_states": np.zeros((1, 3, 4), np.float32)}


@pytest.mark.parametrize("int8_span", [False, True])  # (not "quantized": a slow fixture's name)
def test_the_grouped_cut_is_the_whole_graph_in_every_group(int8_span):
    model = _grouped(int8_span)
    assert len(switches(model)) == 2 and not switches(_group(2.0, 0.05, int8_span))
    sg = split_groups(model, lambda names: SPAN)
    # the rest hands on a float (a quantized output is dequantized inside the span, quantized again in the tail)
    assert sg.rest.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert len(sg.span_outputs) == 1 and sg.span_inputs[-2:] == ["groups/in0", "groups/out_of0"]
    whole = _session(model)
    pieces = [_session(m) for m in (sg.first, sg.rest, sg.tail)]
    for t in (900.0, 100.0):  # group 0, group 1
        feeds = _feeds(t)
        assert np.array_equal(run_whole(*pieces, sg, feeds), whole.run(None, feeds)[0])


def test_a_feature_cached_in_one_group_is_read_with_the_next_groups_scale():
    """The span's quantized output, cached at a step of group 0 (scale 0.05), feeds a cached step of group 1: the
    tail quantizes it with group 1's scale (0.08), not group 0's integers read at 0.08."""
    sg = split_groups(_grouped(True), lambda names: SPAN)
    first, rest, tail = (_session(m) for m in (sg.first, sg.rest, sg.tail))
    names = [o.name for o in first.get_outputs()]

    def pieces_in(t):
        feeds = _feeds(t)
        return feeds, dict(zip(names, first.run(None, {i.name: feeds[i.name] for i in first.get_inputs()})))

    _, f0 = pieces_in(900.0)
    cached = rest.run(None, {n: f0[n] for n in sg.span_inputs})[0]  # group 0: sample * 2 + 2, on 0.05's grid
    feeds, f1 = pieces_in(100.0)
    pool = {**feeds, **f1, sg.span_outputs[0]: cached}
    got = tail.run(None, {i.name: pool[i.name] for i in tail.get_inputs()})[0]
    want = np.clip(np.round(cached / 0.08), -128, 127) * 0.08 + feeds["sample"] * 3.0
    assert np.allclose(got, want, atol=1e-5)


def test_groups_without_module_names_are_refused_in_one_line():
    """A folder quantized before the branches kept their nodes' module paths: re-quantize it (said so)."""
    with pytest.raises(ValueError, match="quantize it again"):
        split_groups(_grouped(False, named=False), lambda names: SPAN)


# --- on a quantized tiny folder (slow: quantize with calibration) ---------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("spec", ["deepcache:2", "deepcache:3:L1"])
def test_deepcache_on_int8_timestep_host_and_loop(tiny_int8_timestep, tiny_onnx, spec, tmp_path):
    """DeepCache runs on an int8-timestep folder (it used to find no skip layers: the branches' nodes had lost their
    names); the no-op spec is the plain run bit for bit, the Loop graph gives the host loop's images, and the
    pictures stay near DeepCache on the fp32 folder."""
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.runtime import Pipeline

    kw = dict(steps=8, seed=3, sampler="ddim")
    pipe = Pipeline.from_folder(tiny_int8_timestep, verify=False)
    base = pipe(PROMPT, **kw).images
    assert np.array_equal(pipe(PROMPT, **kw, cache="deepcache:1").images, base)
    cached = pipe(PROMPT, **kw, cache=spec).images
    fp32 = Pipeline.from_folder(tiny_onnx, verify=False)(PROMPT, **kw, cache=spec).images
    assert np.isfinite(cached).all() and psnr(cached, fp32) > 20
    compile_loop(tiny_int8_timestep, tmp_path / "loop", form="loop", cache=spec)
    looped = Pipeline.from_folder(tmp_path / "loop", verify=False)
    host = looped(PROMPT, **kw, cache=spec).images
    assert np.array_equal(host, cached)
    assert np.array_equal(looped(PROMPT, **kw, cache=spec, loop="loop").images, host)
