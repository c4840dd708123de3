"""`compile-loop --whole` (loopgraph/whole.py) for the LLM-encoder families (issue 42): Z-Image, Qwen-Image, FLUX.2
[klein] and [dev] take the template's token ids and their attention masks, keep each row's tokens in the graph,
and give the host loop's image; a batch of two prompts of different lengths, and a negative prompt of another
length, included. The editing families that read a picture through the text side are refused in one line."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.families import get_family
from onnxdiffusion.families.graph_ends import kept_tokens
from onnxdiffusion.loopgraph.whole import GraphOps, GVal
from whole_feeds import whole_feeds

PROMPTS = ["a small red circle on the left",
           "a big blue square above a yellow triangle on the right, a green ring below a violet star"]
NEGATIVE = "blurry"
H, W = 48, 32  # non-square


class _B:
    """The builder surface GraphOps uses (loopgraph/builder._Builder's)."""

    def __init__(self):
        self.nodes, self.inits = [], []

    def op(self, op_type, inputs, out, **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def const(self, name, value):
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name


@pytest.mark.parametrize("drop, multiple", [(0, 1), (0, 32), (3, 1), (2, 4), (9, 1)])
def test_kept_tokens_graph_twin_matches_numpy(drop, multiple):
    """GraphOps.kept_tokens against the host's numpy form, rows of different lengths (one shorter than `drop`)."""
    rng = np.random.default_rng(drop + multiple)
    lengths, width = [7, 3, 11], 5
    states = rng.standard_normal((3, 11, width)).astype(np.float32)
    mask = np.array([[1] * n + [0] * (11 - n) for n in lengths], np.int64)
    b = _B()
    x, keep = GraphOps(b).kept_tokens(GVal("states", 3, width), GVal("mask", 2, 0), drop, multiple)
    graph = helper.make_graph(
        b.nodes, "kept", [helper.make_tensor_value_info("states", TensorProto.FLOAT, ["b", "l", width]),
                          helper.make_tensor_value_info("mask", TensorProto.INT64, ["b", "l"])],
        [helper.make_tensor_value_info(x.name, TensorProto.FLOAT, None),
         helper.make_tensor_value_info(keep.name, TensorProto.FLOAT, None)], initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got_x, got_mask = sess.run(None, {"states": states, "mask": mask})
    want_x, want_mask = kept_tokens(states, mask, drop, multiple)
    assert got_x.shape == want_x.shape and np.array_equal(got_x, want_x)
    assert np.array_equal(got_mask, want_mask)


@pytest.mark.parametrize("name", ["qwenimage_edit"])  # Kontext's whole graph takes reference latents (page42)
def test_refusals_are_one_line(name):
    why = get_family(name).whole_refusal
    assert why and "\n" not in why


@pytest.mark.slow
@pytest.mark.parametrize("fixture, forms", [("tiny_zimage_onnx", ("loop", "unrolled")), ("tiny_qwenimage_onnx", ("loop",)),
                                            ("tiny_flux2_klein_onnx", ("loop",)), ("tiny_flux2_dev_onnx", ("loop",))])
def test_whole_graph_gives_the_host_image(request, tmp_path, fixture, forms):
    """Acceptance: the --whole graph, run by onnxruntime alone, gives the host loop's uint8 image (bit for bit here;
    the bound is 40 dB) for two prompts of different lengths beside a negative prompt of a third."""
    from onnxdiffusion.loopgraph.compile import compile_loop
    from onnxdiffusion.runtime import Pipeline

    folder = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), folder)
    steps, guidance, sampler = 3, 3.0, "flow_euler"
    for form in forms:
        compile_loop(folder, folder, form=form, steps=steps if form == "unrolled" else None, whole=True)
        pipe = Pipeline.from_folder(folder)
        host = pipe(PROMPTS, negative_prompt=NEGATIVE, steps=steps, guidance=guidance, height=H, width=W, seed=5,
                    sampler=sampler, batch=len(PROMPTS))
        assert host.images.std() > 5  # a picture, not a flat field
        sess = ort.InferenceSession(str(folder / f"sampler_{form}_whole" / "model.onnx"),
                                    providers=["CPUExecutionProvider"])
        feeds = whole_feeds(sess, pipe, host, PROMPTS, NEGATIVE, steps, guidance, sampler)
        image = sess.run(["image"], feeds)[0]
        assert image.dtype == np.uint8 and image.shape == host.images.shape
        assert psnr(image, host.images) >= 40, form
        # the mask is read: unmasking the padding changes the picture
        unmasked = sess.run(["image"], {**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})[0]
        assert not np.array_equal(unmasked, image)


@pytest.mark.slow
def test_editing_families_are_refused_in_one_line(tiny_qwenedit_onnx, tmp_path):
    from onnxdiffusion.loopgraph.compile import compile_loop

    for folder, name in ((tiny_qwenedit_onnx, "qwenimage_edit"),):
        with pytest.raises(UserError, match=f"--whole is not available for {name} folders: ") as err:
            compile_loop(folder, tmp_path / name, form="loop", whole=True)
        assert "\n" not in str(err.value)
        assert not (tmp_path / name).exists()
