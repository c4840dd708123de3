"""Lossless float16 storage (onnxio.fp16_storage, `relayout --storage`): same graphs for the tools, same images."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxdiffusion.folder.artifacts import load_component, read_manifest
from onnxdiffusion.onnxio import fp16_storage
from onnxdiffusion.folder.relayout import store_external
from onnxdiffusion.runtime import Pipeline

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MMDIT_MODEL = ROOT / "models" / "shapes-mmdit-onnx"

SD_MODEL = ROOT / "models" / "shapes-sd-onnx"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tiny(exact: bool, legit_cast: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 64)).astype(np.float16).astype(np.float32)
    w[0, 0] = -0.0  # the sign of zero must survive
    b = rng.standard_normal(64).astype(np.float32) if not exact else np.arange(64, dtype=np.float32) / 4
    v = rng.standard_normal((64, 8)).astype(np.float32)  # not float16-exact: stays float32
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), numpy_helper.from_array(v, "v")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["g"]),
             helper.make_node("MatMul", ["g", "v"], ["y"])]
    if legit_cast:  # a graph that casts a float16 initializer itself, not stored by us
        inits.append(numpy_helper.from_array(np.ones(64, np.float16), "k__fp16"))
        nodes.insert(0, helper.make_node("Cast", ["k__fp16"], ["k"], to=TensorProto.FLOAT))
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_store_expand_round_trip_is_byte_identical_and_computes_the_same():
    model = _tiny(exact=True)
    original = model.SerializeToString()
    assert fp16_storage.store(model) == 2  # w and b; v is not float16-exact
    stored = model.SerializeToString()
    assert len(stored) < len(original)
    assert {t.name: t.data_type for t in model.graph.initializer}["w__fp16"] == TensorProto.FLOAT16
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    run = lambda b: ort.InferenceSession(b, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    assert np.array_equal(run(original), run(stored))
    back = fp16_storage.expand(onnx.load_from_string(stored))
    assert back.SerializeToString() == original
    assert fp16_storage.store(back) == 2 and back.SerializeToString() == stored  # deterministic


def test_inexact_weights_and_unmarked_casts_are_left_alone():
    model = _tiny(exact=False)
    assert fp16_storage.store(model) == 1  # only w: b is not float16-exact
    assert "b" in {t.name for t in model.graph.initializer}
    legit = _tiny(exact=False, legit_cast=True)
    before = legit.SerializeToString()
    assert fp16_storage.expand(legit).SerializeToString() == before  # no mark: not ours to undo


def test_the_shipped_mmdit_is_stored_in_fp16_and_tools_see_float32():
    manifest = read_manifest(MMDIT_MODEL)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae_decoder", "vae_encoder"):
        raw = onnx.load(str(MMDIT_MODEL / manifest["components"][name]["path"]))
        assert fp16_storage.is_stored(raw), name
        tool = load_component(MMDIT_MODEL, manifest, name)
        assert not fp16_storage.is_stored(tool)
        assert all(t.data_type != TensorProto.FLOAT16 for t in tool.graph.initializer), name
        assert not [n for n in tool.graph.node if n.op_type == "Cast" and n.input[0].endswith(fp16_storage.SUFFIX)]


def test_the_shipped_sd_model_has_no_float16_exact_weights():
    """shapes-sd-onnx was exported from the float32 training weights: --storage fp16 finds nothing to store."""
    manifest = read_manifest(SD_MODEL)
    unet = onnx.load(str(SD_MODEL / manifest["components"]["unet"]["path"]))
    assert fp16_storage.store(unet) == 0


@pytest.mark.slow
def test_relayout_storage_round_trip_gives_identical_folders_and_images(tmp_path):
    plain, again = tmp_path / "fp32", tmp_path / "fp16"
    from cli_helpers import run_cli_here  # the verb in-process: no interpreter start per call

    for src, out, storage in ((MMDIT_MODEL, plain, "fp32"), (plain, again, "fp16")):
        r = run_cli_here("relayout", src, out, "--storage", storage)
        assert r.returncode == 0, r.stderr
    manifest = read_manifest(MMDIT_MODEL)
    for info in manifest["components"].values():
        rel = info["path"]
        if rel.endswith(".onnx"):
            assert _sha(again / rel) == _sha(MMDIT_MODEL / rel), rel
            assert (plain / rel).stat().st_size > (MMDIT_MODEL / rel).stat().st_size, rel
    assert store_external(MMDIT_MODEL, tmp_path / "keep") == []  # already stored, nothing large: no rewrite
    prompts = ["a red circle on the left", "a blue star above a yellow square"]
    a = Pipeline.from_folder(MMDIT_MODEL)(prompts, batch=2, steps=6, seed=3)
    b = Pipeline.from_folder(plain)(prompts, batch=2, steps=6, seed=3)
    assert np.array_equal(a.latents, b.latents) and np.array_equal(a.images, b.images)


def test_bad_storage_is_one_line(tmp_path):
    from cli_helpers import run_cli_here  # in-process: no interpreter start for a one-line refusal

    r = run_cli_here("relayout", MMDIT_MODEL, tmp_path / "o", "--storage", "bf16")
    assert r.returncode != 0 and "storage must be one of keep, fp16, fp32" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_a_float16_tensor_that_does_not_fit_its_dims_is_one_line():
    from onnxdiffusion.errors import UserError

    model = _tiny(exact=True)
    fp16_storage.store(model)
    t = next(t for t in model.graph.initializer if t.name == "w__fp16")
    t.dims[0] = 3  # a crafted file: 16 x 64 values under dims 3 x 64
    with pytest.raises(UserError, match="w__fp16.*does not match its shape"):
        fp16_storage.expand(model, "crafted.onnx")
