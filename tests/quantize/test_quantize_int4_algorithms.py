"""int4-weights `algorithm`: ORT's HQQ (per node, float zero points) and GPTQ (whole model, Hessians from the
calibration trajectories) beside the default min/max rounding. Tiny real UNet; images vs fp32 in dB."""

import numpy as np
import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.quantize import CalibrationConfig, Int4WeightsRecipe, QuantizeConfig, quantize, recipe_class, recipe_from_dict
from onnxdiffusion.quantize import _ort, files
from onnxdiffusion.quantize.graphs import quantizable_nodes
from onnxdiffusion.quantize.recipes import prepare_unet
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

CAL = CalibrationConfig(count=4, steps=3, batch=4)
FAST = dict(calibration=CAL, latency_runs=1, measure_memory=False)
PROMPTS = ["a red circle on the left", "a blue star at the top"]
GEN = dict(steps=3, guidance=4.0, seed=1, batch=2)


def test_algorithm_is_a_typed_versioned_option():
    assert Int4WeightsRecipe.version == 4 and Int4WeightsRecipe().algorithm == "default"
    assert recipe_from_dict({"name": "int4-weights", "version": 3}).algorithm == "default"
    assert recipe_from_dict(Int4WeightsRecipe(algorithm="hqq").to_dict()).algorithm == "hqq"
    assert Int4WeightsRecipe(algorithm="gptq").calibrated and not Int4WeightsRecipe(algorithm="hqq").calibrated
    with pytest.raises(UserError, match="algorithm must be one of default, hqq, gptq"):
        recipe_class("int4-weights").with_options({"algorithm": "awq"})


@pytest.mark.parametrize("algorithm", ["hqq", "gptq"])
def test_each_algorithm_writes_matmulnbits_that_run_on_onnxruntime_alone(algorithm, tiny_onnx, tmp_path):
    if algorithm == "hqq":
        pytest.importorskip("torch", reason="HQQ runs on torch at quantize time (the export extra)")
    fp32 = Pipeline.from_folder(tiny_onnx)(PROMPTS, **GEN).images
    runs = {}
    for name in ("default", algorithm):
        recipe = recipe_class("int4-weights").with_options({"block_size": "16", "algorithm": name})
        report = quantize(tiny_onnx, tmp_path / name, QuantizeConfig(recipe=recipe, **FAST))
        model = onnx.load(str(tmp_path / name / "unet" / "model.onnx"))
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert nbits and report["details"]["algorithm"] == name
        runs[name] = (nbits, model, Pipeline.from_folder(tmp_path / name)(PROMPTS, **GEN).images)
    (n_def, _, img_def), (n_alg, m_alg, img_alg) = runs["default"], runs[algorithm]
    assert len(n_alg) == len(n_def)  # the same MatMuls, other weights
    assert not np.array_equal(img_alg, img_def)
    assert psnr(img_alg, fp32) > 20  # a real 4-bit model, not a broken one
    if algorithm == "hqq":  # float zero points (input 3 has the scales' type)
        inits = {t.name: t for t in m_alg.graph.initializer}
        zp = inits[n_alg[0].input[3]]
        assert zp.data_type == inits[n_alg[0].input[2]].data_type == onnx.TensorProto.FLOAT


def test_gptq_refuses_a_backbone_past_the_inline_limit(tiny_onnx, monkeypatch):
    from onnxdiffusion.onnxio import files as onnxio_files

    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", 64 << 10)
    sk = prepare_unet(files.load_backbone(tiny_onnx / "unet" / "model.onnx"))
    names = [q.name for q in quantizable_nodes(sk, ("MatMul",))]
    with pytest.raises(UserError, match="only backbones under 2 GB"):
        _ort.gptq_int4_quantize(sk, names, 16, 0, [])


_GPTQ_SHA = """
import hashlib, sys
from pathlib import Path
from onnxdiffusion.folder.artifacts import read_manifest
from onnxdiffusion.quantize import _ort, files
from onnxdiffusion.quantize.graphs import quantizable_nodes
from onnxdiffusion.quantize.recipes import prepare_unet
from onnxdiffusion.quantize.report import component_feed

def sha(folder):
    model = prepare_unet(files.load_backbone(folder / "unet" / "model.onnx"))
    names = [q.name for q in quantizable_nodes(model, ("MatMul",))]
    feeds = [component_feed("unet", read_manifest(folder), seed=s) for s in range(2)]
    done = _ort.gptq_int4_quantize(model, names, 16, 0, feeds)
    return hashlib.sha256(done.SerializeToString()).hexdigest()

if __name__ == "__main__":
    print(sha(Path(sys.argv[1])))
"""


def test_gptq_writes_the_same_bytes_whatever_the_string_hash_seed(tiny_onnx):
    # INC walks the MatMul inputs through a set: its packed weights came in hash order (another order each run).
    # Three string hash seeds: this process's own (random unless PYTHONHASHSEED is set) and two others in child
    # processes; a third child would only add an interpreter start and its imports
    import os
    import subprocess
    import sys
    from pathlib import Path

    here: dict = {"__name__": "gptq_sha"}
    exec(_GPTQ_SHA, here)
    digests = {here["sha"](Path(tiny_onnx))}
    src = str(Path(_ort.__file__).resolve().parents[2])
    for seed in [s for s in ("1", "2", "3") if s != os.environ.get("PYTHONHASHSEED")][:2]:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": src}
        out = subprocess.run([sys.executable, "-c", _GPTQ_SHA, str(tiny_onnx)], env=env, capture_output=True, text=True,
                             check=True)
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1, digests


def test_added_initializers_follow_the_kept_ones_in_name_order():
    from onnx import helper

    graph = helper.make_graph([], "g", [], [], initializer=[
        helper.make_tensor(n, onnx.TensorProto.FLOAT, [1], [0.0]) for n in ("k2", "new_b", "k1", "new_a")])
    model = helper.make_model(graph)
    _ort._new_initializers_by_name(model, {"k1", "k2"})
    assert [t.name for t in model.graph.initializer] == ["k2", "k1", "new_a", "new_b"]


def test_weights_8bit_is_a_typed_option_left_out_of_the_dict_when_empty():
    assert "weights_8bit" not in Int4WeightsRecipe().to_dict() and "weights_8bit" not in recipe_class("w4a8")().to_dict()
    recipe = recipe_class("w4a8").with_options({"weights_8bit": "*/proj_out/*, */ff/net.2/*"})
    assert recipe.weights_8bit == ("*/proj_out/*", "*/ff/net.2/*")
    assert recipe.to_dict()["weights_8bit"] == ["*/proj_out/*", "*/ff/net.2/*"] and recipe_from_dict(recipe.to_dict()) == recipe


def test_weights_8bit_gives_the_named_linears_8bit_weights_and_refuses_a_pattern_that_matches_none(tiny_onnx, tmp_path):
    sk = prepare_unet(files.load_backbone(tiny_onnx / "unet" / "model.onnx"))
    first = quantizable_nodes(sk, ("MatMul",))[0].name
    recipe = recipe_class("w4a8").with_options({"block_size": "16", "weights_8bit": first})
    report = quantize(tiny_onnx, tmp_path / "q", QuantizeConfig(recipe=recipe, **FAST))
    assert report["details"]["weights_8bit_named"] == [first]
    model = onnx.load(str(tmp_path / "q" / "unet" / "model.onnx"))
    bits = [a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
    assert bits.count(8) == 1 and bits.count(4) > 0
    bad = recipe_class("w4a8").with_options({"block_size": "16", "weights_8bit": "*/no_such_linear/*"})
    with pytest.raises(UserError, match="matches no MatMul"):
        quantize(tiny_onnx, tmp_path / "bad", QuantizeConfig(recipe=bad, **FAST))
    assert not (tmp_path / "bad").exists()
