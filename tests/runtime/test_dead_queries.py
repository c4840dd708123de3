"""Joint attention's unread query rows (runtime.dead_queries): the rewrite computes the same outputs, and is made
only where the graph shows it exact."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.runtime.dead_queries import prune_dead_queries, without_dead_queries

ROOT = Path(__file__).resolve().parents[2]
D, HEADS, N_IMG, N_TXT = 16, 2, 6, 9


def joint_attention(read: str, quantized_output: bool = False) -> onnx.ModelProto:
    """img, txt -> q/k/v projections -> MHA(Concat(q_img, q_txt), ...) -> slices; `read`: which slices are outputs
    ("img": [0:len(img)], "txt": [len(img):end], "both", "img+full": the image slice and the whole output)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), f"w{k}") for k in range(6)]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("zero", [0]), ("one", [1]), ("idx1", 1), ("open", [2**62]), ("ax0", [0]))]
    inits += [numpy_helper.from_array(np.array(0.05, np.float32), "qs"), numpy_helper.from_array(np.array(0, np.uint8), "qz")]
    nodes = []
    for stream, base in (("img", 0), ("txt", 3)):
        nodes.append(helper.make_node("LayerNormalization", [stream, "gamma"], [f"{stream}_n"], axis=-1))
        for k, name in enumerate("qkv"):
            nodes.append(helper.make_node("MatMul", [f"{stream}_n", f"w{base + k}"], [f"{stream}_{name}"]))
    inits.append(numpy_helper.from_array(np.ones(D, np.float32), "gamma"))
    for name in "qkv":
        nodes.append(helper.make_node("Concat", [f"img_{name}", f"txt_{name}"], [f"{name}"], axis=1))
    nodes.append(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["att"], domain="com.microsoft", num_heads=HEADS))
    src = "att"
    if quantized_output:
        nodes += [helper.make_node("QuantizeLinear", ["att", "qs", "qz"], ["att_q"]),
                  helper.make_node("DequantizeLinear", ["att_q", "qs", "qz"], ["att_dq"])]
        src = "att_dq"
    nodes += [helper.make_node("Shape", ["img_n"], ["shp"]), helper.make_node("Gather", ["shp", "idx1"], ["len"], axis=0),
              helper.make_node("Unsqueeze", ["len", "ax0"], ["len1"]),
              helper.make_node("Slice", [src, "zero", "len1", "one", "one"], ["out_img"]),
              helper.make_node("Slice", [src, "len1", "open", "one", "one"], ["out_txt"])]
    outs = {"img": ["out_img"], "txt": ["out_txt"], "both": ["out_img", "out_txt"], "img+full": ["out_img", src]}[read]
    graph = helper.make_graph(nodes, "joint", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", s, D])
                                               for n, s in (("img", "s_img"), ("txt", "s_txt"))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


FEEDS = {"img": np.random.default_rng(1).standard_normal((2, N_IMG, D)).astype(np.float32),
         "txt": np.random.default_rng(2).standard_normal((2, N_TXT, D)).astype(np.float32)}


@pytest.mark.slow
@pytest.mark.parametrize("read,quantized", [("img", False), ("txt", False), ("img", True)])
def test_one_stream_read_gets_its_queries_alone_and_the_same_outputs(read, quantized):
    model = joint_attention(read, quantized)
    want = run(model, FEEDS)
    assert without_dead_queries(model)
    mha = next(n for n in model.graph.node if n.op_type == "MultiHeadAttention")
    assert mha.input[0] == f"{read}_q"
    other = "txt" if read == "img" else "img"
    assert f"{other}_q" not in {o for n in model.graph.node for o in n.output}  # its projection is gone too
    got = run(model, FEEDS)
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("read", ["both", "img+full"])
def test_left_alone_when_every_row_is_read(read):
    model = joint_attention(read)
    before = model.SerializeToString()
    assert prune_dead_queries(model) == 0 and not without_dead_queries(model)
    assert model.SerializeToString() == before


def test_left_alone_when_the_slice_bound_is_not_the_streams_length():
    model = joint_attention("img")
    shape = next(n for n in model.graph.node if n.op_type == "Shape")
    shape.input[0] = "txt_n"  # the slice now ends at the text's length: not the image part's rows
    assert prune_dead_queries(model) == 0


def test_the_embedded_mmdit_backbone_session_loses_only_unread_rows():
    """runtime.loading's backbone session: the shipped MMDiT's last block (no text output) is rewritten, and
    the backbone computes exactly what the file's graph computes."""
    from onnxdiffusion.onnxio.session import make_session
    from onnxdiffusion.runtime.loading import _without_dead_queries

    path = ROOT / "models/shapes-mmdit-onnx/transformer/model.onnx"
    rewritten = _without_dead_queries(path)
    assert rewritten is not None
    model = onnx.load_from_string(rewritten)
    assert sum(n.op_type == "MultiHeadAttention" for n in model.graph.node) == 6
    rng = np.random.default_rng(0)
    feeds = {"sample": rng.standard_normal((2, 4, 16, 16), dtype=np.float32), "timestep": np.array([500.0, 20.0], np.float32),
             "encoder_hidden_states": rng.standard_normal((2, 280, 160), dtype=np.float32),
             "pooled_projections": rng.standard_normal((2, 256), dtype=np.float32)}
    plain, pruned = make_session(path, threads=1), make_session(path, threads=1, model=rewritten)
    assert len(model.graph.node) < len(onnx.load(str(path), load_external_data=False).graph.node)
    np.testing.assert_array_equal(pruned.run(None, feeds)[0], plain.run(None, feeds)[0])
