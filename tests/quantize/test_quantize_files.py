"""quantize on backbones past protobuf's 2 GB limit, exercised on the tiny pipeline with the limit lowered;
calibration statistics reduced in the graph (min/max, streamed histograms)."""

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf.message import EncodeError

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize, recipe_class
from onnxdiffusion.onnxio import files as onnxio_files
from onnxdiffusion.quantize import files, recipes, runner
from onnxdiffusion.quantize.calibration import capture, histogram_ranges, step_ranges
from onnxdiffusion.quantize.graphs import activation_tensors, quantizable_nodes
from onnxdiffusion.quantize.recipes import prepare_unet
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

CAL = CalibrationConfig(count=4, steps=3, batch=4)
FAST = dict(calibration=CAL, latency_runs=1, measure_memory=False)
PROMPTS = ["a red circle on the left", "a blue star at the top"]
GEN = dict(steps=3, guidance=4.0, seed=1, batch=2)
LIMIT = 64 << 10  # the tiny UNet has ~50x this in weights (3.1 MB)


@pytest.fixture
def two_gb_limit(monkeypatch):
    """Lower the inline limit to LIMIT and make every serialization point fail past it, as protobuf
    does past 2 GB: whole-model bytes into ONNX Runtime, shape inference, inline saves."""
    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", LIMIT)
    real_session, real_infer, real_save = ort.InferenceSession.__init__, onnx.shape_inference.infer_shapes, onnx.save_model
    seen = {"bytes": 0}

    def session(self, path_or_bytes, *a, **kw):
        if isinstance(path_or_bytes, bytes):
            carried = _inline_bytes(onnx.load_from_string(path_or_bytes))
            seen["bytes"] = max(seen["bytes"], carried)
            if carried > LIMIT:
                raise EncodeError("Failed to serialize proto (test limit)")
        return real_session(self, path_or_bytes, *a, **kw)

    def infer(model, *a, **kw):
        if _inline_bytes(model) > LIMIT:
            raise EncodeError("Failed to serialize proto (test limit)")
        return real_infer(model, *a, **kw)

    def save(model, f, *a, **kw):
        if isinstance(model, onnx.ModelProto) and not kw.get("save_as_external_data") and _inline_bytes(model) > LIMIT:
            raise EncodeError("Failed to serialize proto (test limit)")
        return real_save(model, f, *a, **kw)

    monkeypatch.setattr(ort.InferenceSession, "__init__", session)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", infer)
    monkeypatch.setattr(onnx, "save_model", save)
    return seen


def _inline_bytes(model):
    """What serializing the model would carry: tensors held in memory, not external references."""
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer
               if t.data_location != onnx.TensorProto.EXTERNAL)


def _weights(folder):
    model = onnx.load(str(folder / "unet" / "model.onnx"))
    return model, {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("name, options", [
    ("int8-static", {}),
    ("int8-static", {"calibrator": "percentile"}),
    ("int4-weights", {"block_size": "16", "others": "int8"}),
    ("int4-weights", {"block_size": "16"}),
    ("int8-dynamic", {}),
])
def test_large_backbone_quantizes_through_files_to_the_same_model(name, options, external_onnx, tmp_path,
                                                                   two_gb_limit, monkeypatch):
    recipe = recipe_class(name).with_options(options)
    report = quantize(external_onnx, tmp_path / "large", QuantizeConfig(recipe=recipe, **FAST))
    assert two_gb_limit["bytes"] <= LIMIT  # sessions got skeletons or small models, never the whole one
    entry = json.loads((tmp_path / "large" / "manifest.json").read_text())["components"]["unet"]
    assert entry["external_data"] == ["unet/model.onnx_data"]  # the output is large too: external data
    assert report["sizes"]["unet"]["bytes"] > LIMIT and report["quality"]["probe_psnr_db"] > 15
    monkeypatch.undo()  # the same recipe in memory, as before this path existed
    quantize(external_onnx, tmp_path / "small", QuantizeConfig(recipe=recipe, **FAST))
    (large, wl), (small, ws) = _weights(tmp_path / "large"), _weights(tmp_path / "small")
    assert [n.op_type for n in large.graph.node] == [n.op_type for n in small.graph.node]
    assert wl.keys() == ws.keys() and all(np.array_equal(wl[k], ws[k]) for k in wl)
    a = Pipeline.from_folder(tmp_path / "large")(PROMPTS, **GEN).images
    b = Pipeline.from_folder(tmp_path / "small")(PROMPTS, **GEN).images
    assert np.array_equal(a, b)


@pytest.mark.parametrize("bits, symmetric, block", [(4, True, 16), (4, False, 32), (8, True, 16)])
def test_int4_tensor_by_tensor_equals_ort_whole_model_quantizer(bits, symmetric, block, external_onnx, monkeypatch):
    """_ort.int4_quantize (one weight read at a time) gives exactly what ORT's MatMulNBitsQuantizer gives on
    the whole in-memory model; on a skeleton it reads only the quantized weights and stays a skeleton."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from onnxdiffusion.quantize import _ort

    path = external_onnx / "unet" / "model.onnx"
    unet = prepare_unet(files.load_backbone(path))  # small: whole, read by our reader (other tests hard-link the data)
    assert files.data_dir(unet) is None
    mms = [q.name for q in quantizable_nodes(unet, ("MatMul",)) if q.weight_size >= block]
    chosen = mms[::2]  # some MatMuls stay float
    assert len(chosen) >= 4 and len(mms) > len(chosen)
    ref = onnx.ModelProto()
    ref.CopyFrom(unet)
    q = MatMulNBitsQuantizer(ref, bits=bits, block_size=block, is_symmetric=symmetric, op_types_to_quantize=("MatMul",),
                             nodes_to_exclude=[n.name for n in ref.graph.node if n.op_type == "MatMul" and n.name not in chosen])
    q.process()
    ref = q.model.model
    ours = _ort.int4_quantize(unet, chosen, block, symmetric, 0, bits)
    assert [(n.op_type, list(n.input), list(n.output)) for n in ours.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in ref.graph.node]
    assert [n.attribute for n in ours.graph.node] == [n.attribute for n in ref.graph.node]
    w_ours = {t.name: onnx.numpy_helper.to_array(t) for t in ours.graph.initializer}
    w_ref = {t.name: onnx.numpy_helper.to_array(t) for t in ref.graph.initializer}
    assert w_ours.keys() == w_ref.keys() and all(np.array_equal(w_ours[k], w_ref[k]) for k in w_ref)
    assert sum(n.op_type == "MatMulNBits" for n in ours.graph.node) == len(chosen)

    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", LIMIT)
    sk = prepare_unet(files.load_backbone(path))
    assert files.data_dir(sk) is not None
    read = []
    real_array = files.array
    monkeypatch.setattr(files, "array", lambda m, t: read.append(t.name) or real_array(m, t))
    lean = _ort.int4_quantize(sk, chosen, block, symmetric, 0, bits)
    by_name = {n.name: n for n in unet.graph.node}
    assert sorted(read) == sorted(by_name[n].input[1] for n in chosen)  # only the quantized weights were read
    assert files.data_dir(lean) is not None and _inline_bytes(lean) < files.tensor_bytes(lean) / 4
    full = files.with_weights(lean)
    w_lean = {t.name: onnx.numpy_helper.to_array(t) for t in full.graph.initializer}
    assert w_lean.keys() == w_ref.keys() and all(np.array_equal(w_lean[k], w_ref[k]) for k in w_ref)


def test_skeleton_holds_no_weights_and_ignores_a_planted_data_folder(external_onnx, tmp_path, monkeypatch):
    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", LIMIT)
    path = external_onnx / "unet" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    model.metadata_props.add(key=files.DATA_DIR_KEY, value="/etc")
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    os.link(external_onnx / "unet" / "model.onnx_data", tmp_path / "model.onnx_data")  # hard links are read too
    sk = files.load_backbone(tmp_path / "model.onnx")
    assert files.data_dir(sk) == tmp_path.resolve() and _inline_bytes(sk) < 0.01 * files.tensor_bytes(sk)
    assert files.tensor_bytes(sk) > 40 * LIMIT
    full = files.with_weights(sk)
    assert files.data_dir(full) is None and full.ByteSize() > files.tensor_bytes(sk)
    monkeypatch.undo()
    assert files.data_dir(files.load_backbone(tmp_path / "model.onnx")) is None  # small: loaded whole


def test_an_unserializable_model_is_a_one_line_user_error(external_onnx, tmp_path, two_gb_limit, monkeypatch):
    def boom(ctx, recipe):
        raise EncodeError("Failed to serialize proto")

    monkeypatch.setitem(recipes.BUILDERS, Int8StaticRecipe, boom)
    with pytest.raises(UserError, match="2 GB limit") as e:
        quantize(external_onnx, tmp_path / "out", QuantizeConfig(recipe=Int8StaticRecipe(), **FAST))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def calib(tiny_onnx):
    pipe = Pipeline.from_folder(tiny_onnx)
    unet = prepare_unet(onnx.load(str(tiny_onnx / "unet" / "model.onnx")))
    nodes = [q.name for q in quantizable_nodes(unet, ("Conv", "MatMul", "Gemm"))]
    return unet, activation_tensors(unet, nodes), capture(pipe, ["a red circle", "a blue star", "a green square", "a ring"], CAL)


def test_in_graph_minmax_equals_the_activations_min_max(calib):
    unet, tensors, cal = calib
    stats = step_ranges(unet, tensors, cal)
    aug = onnx.ModelProto()
    aug.CopyFrom(unet)
    aug.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors)
    sess = runner.session(aug)
    for s in range(cal.num_steps):
        got = sess.run(tensors, cal.feed(s))
        assert np.array_equal(stats.lo[s], [v.min() for v in got]) and np.array_equal(stats.hi[s], [v.max() for v in got])


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_streamed_histogram_ranges_equal_ort_calibrator_on_one_batch(method, calib, tmp_path):
    """One batch: ORT's calibrator's histogram has exactly our fixed range, so the thresholds must agree."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    unet, tensors, cal = calib
    stats = step_ranges(unet, tensors, cal)
    bins = 256 if method == "entropy" else 512  # ORT's entropy search is O(bins^2) per tensor in Python
    ours = histogram_ranges(unet, tensors, stats, cal, method, bins, 99.9, steps=[1])
    onnx.save_model(unet, str(tmp_path / "m.onnx"))
    cm = CalibrationMethod.Entropy if method == "entropy" else CalibrationMethod.Percentile
    extra = {"num_bins": bins, "num_quantized_bins": 128, "symmetric": False} if method == "entropy" else \
        {"num_bins": bins, "percentile": 99.9, "symmetric": True}
    calibrator = create_calibrator(tmp_path / "m.onnx", ["Conv", "MatMul", "Gemm"], str(tmp_path / "aug.onnx"),
                                   calibrate_method=cm, extra_options=extra)
    calibrator.collect_data(_OneFeed(cal.feed(1)))
    theirs = {k: v.range_value for k, v in calibrator.compute_data().data.items()}
    common = [t for t in tensors if t in theirs]
    assert len(common) > 0.9 * len(tensors)
    far = [t for t in common if not np.allclose(ours[t], [float(x) for x in theirs[t]], rtol=1e-3, atol=1e-5)]
    assert len(far) <= 0.02 * len(common), far[:5]  # bin-edge float rounding may move a rare threshold a bin
    assert any(abs(ours[t][1] - stats.aggregate([1])[t][1]) > 1e-6 for t in common)  # not just min/max


class _OneFeed:
    def __init__(self, feed):
        self.feeds = [feed]

    def get_next(self):
        return self.feeds.pop() if self.feeds else None


def test_stat_nodes_sit_right_after_their_tensor(calib):
    """So that ORT's priority-based order frees each activation when the backbone is done with it."""
    from onnxdiffusion.quantize.stats import histogram_model, minmax_model

    unet, tensors, _ = calib
    for aug, _ in (minmax_model(unet, tensors), histogram_model(unet, tensors, [(-1.0, 1.0)] * len(tensors), 16)):
        order = {o: i for i, n in enumerate(aug.graph.node) for o in n.output}
        for t in tensors:
            if t in order:  # not a graph input
                first_stat = min(i for i, n in enumerate(aug.graph.node) if t in n.input and n.name.startswith("calib_stat"))
                plain_between = [n for n in aug.graph.node[order[t] + 1:first_stat] if not n.name.startswith("calib_stat")]
                assert not plain_between, t


def test_no_quality_skips_the_fp32_references_and_refuses_correct(tiny_onnx, tmp_path):
    report = quantize(tiny_onnx, tmp_path / "q", QuantizeConfig(recipe=recipe_class("int8-dynamic")(), **FAST),
                      measure_quality=False)
    assert report["quality"] == {} and report["latency"]
    with pytest.raises(UserError, match="needs --quality"):
        quantize(tiny_onnx, tmp_path / "c", QuantizeConfig(recipe=Int8StaticRecipe(), correct=True, **FAST),
                 measure_quality=False)
    assert not (tmp_path / "c").exists()
