"""quantize on a backbone whose export put everything in external data, the Constants' values too (torch's
exporter does past 2 GB: the FLUX.2 [klein] proof's int8-dynamic failed on it), and the streamed int8 path."""

import json
import shutil

import numpy as np
import onnx
import pytest

from onnxdiffusion.folder.artifacts import hash_tree
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

FAST = dict(calibration=CalibrationConfig(count=4, steps=3, batch=4), latency_runs=1, measure_memory=False)
GEN = dict(steps=3, guidance=4.0, seed=1, batch=1)


def external_copy(src, out, threshold: int = 64):
    """`src` with its UNet saved as export writes a > 2 GB one: every tensor over `threshold` bytes, node
    attributes (Constant values) included, in one external-data file."""
    shutil.copytree(src, out)
    path = out / "unet" / "model.onnx"
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx_data", size_threshold=threshold, convert_attribute=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["components"]["unet"]["external_data"] = ["unet/model.onnx_data"]
    manifest["files"] = hash_tree(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


@pytest.fixture(scope="module")
def constants_external(tiny_onnx, tmp_path_factory):
    out = external_copy(tiny_onnx, tmp_path_factory.mktemp("attr") / "model")
    unet = onnx.load(str(out / "unet" / "model.onnx"), load_external_data=False)
    external = [a.t for n in unet.graph.node for a in n.attribute
                if a.HasField("t") and a.t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) > 10  # the Constants' values are in the data file, as in the klein export
    return out


@pytest.fixture(scope="module")
def inline_ref(tiny_onnx, tiny_int8_static, tmp_path_factory):
    """The recipe on the inline folder, once per recipe for both limits. int8-static's is conftest's shared
    tiny_int8_static: the same call (Int8StaticRecipe(), 4 x 3 DDIM calibration in batches of 4, latency_runs=1,
    measure_memory=False; DDIM is the calibration default), which the step-cache and ControlNet tests quantize
    once per run anyway; its report is the one quantize wrote beside it."""
    from onnxdiffusion.quantize.report import REPORT_NAME

    made = {"int8-static": {"folder": tiny_int8_static,
                            "report": json.loads((tiny_int8_static / REPORT_NAME).read_text())}}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp("ref") / name
            made[name] = {"folder": folder,
                          "report": quantize(tiny_onnx, folder, QuantizeConfig(recipe=recipe_class(name)(), **FAST))}
        return made[name]
    return get


def _weights(folder):
    model = onnx.load(str(folder / "unet" / "model.onnx"))
    return model, {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("name", ["int8-dynamic", "int8-static"])
@pytest.mark.parametrize("limit", [None, 64 << 10])  # in memory; past the (lowered) inline limit: a skeleton
def test_constants_in_external_data_quantize_as_inline_ones(name, limit, constants_external, inline_ref, tmp_path,
                                                            monkeypatch):
    from onnxdiffusion.onnxio import files as onnxio_files

    recipe = recipe_class(name)()
    ref = inline_ref(name)
    if limit is not None:
        monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", limit)
    report = quantize(constants_external, tmp_path / "ext", QuantizeConfig(recipe=recipe, **FAST))
    monkeypatch.undo()
    (a, wa), (b, wb) = _weights(ref["folder"]), _weights(tmp_path / "ext")
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert report["quality"]["probe_psnr_db"] == ref["report"]["quality"]["probe_psnr_db"]
    x = Pipeline.from_folder(ref["folder"])("a red circle on the left", **GEN).images
    y = Pipeline.from_folder(tmp_path / "ext")("a red circle on the left", **GEN).images
    assert np.array_equal(x, y)
