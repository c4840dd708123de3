"""quantize on every family's backbone: each recipe runs, and its Loop form matches its host loop.

The report's quality (backbone SQNR over fp32 trajectories, probe images) is measured in the plain int8-static
case of each family only (that it is there is checked): no case here checks its numbers, and each measurement
runs the fp32 and the quantized backbone again (experiments/house/test_time.md)."""

import json
import shutil

import pytest

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.loopgraph.compile import compile_loop
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class
from onnxdiffusion.quantize.report import REPORT_NAME
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.slow

RECIPES = [("fp16", {}), ("int8-dynamic", {}), ("int8-static", {}), ("int4-weights", {"block_size": "16"}),
           ("int8-static", {"attention": "int8", "smooth_alpha": "0.5"}), ("int8-timestep", {"groups": "2"}),
           ("int8-static", {"smooth_alpha": "0.5", "keep_sensitive": "0.1"}), ("int8-static", {"bias_correction": "1"}),
           ("mixed", {"target_psnr": "60", "probe_prompts": "2", "sensitivity_steps": "1"}),
           # per-token dynamic linears: after rotation, convs static; and with no static node left (convs float)
           ("int8-static", {"rotate": "hadamard:16", "activations": "dynamic-token"}),
           ("int8-static", {"activations": "dynamic-token", "op_types": "MatMul,Gemm"}),
           # and their int8 weights rounded by GPTQ on the rotated inputs' Hessians
           ("int8-static", {"rotate": "hadamard:16", "activations": "dynamic-token-asym", "weights": "gptq"})]
# family fixture -> (backbone folder, a deterministic sampler of its parameterization)
FAMILIES = {"tiny_sdxl_onnx": ("unet", "ddim"), "tiny_sd3_onnx": ("transformer", "flow_euler")}
# the plain int8-static case's folder where conftest quantizes the same call once per run for other tests too
PLAIN_SHARED = {"tiny_sd3_onnx": "tiny_sd3_int8_static"}


@pytest.mark.parametrize("name, options", RECIPES, ids=[r[0] + "".join(f"-{k}={v}" for k, v in r[1].items()) for r in RECIPES])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_recipe_on_family_backbone_loop_matches_host(family, name, options, request, tmp_path):
    folder = request.getfixturevalue(family)
    backbone, sampler = FAMILIES[family]
    out = tmp_path / name
    cal = CalibrationConfig(count=4, steps=3, batch=4, sampler=sampler)
    measured = name == "int8-static" and not options
    if measured and family in PLAIN_SHARED:  # the call below, made once per run: its copy and its report
        shared = request.getfixturevalue(PLAIN_SHARED[family])
        shutil.copytree(shared, out)
        report = json.loads((shared / REPORT_NAME).read_text())
    else:
        report = quantize(folder, out, QuantizeConfig(recipe=recipe_class(name).with_options(options), calibration=cal,
                                                      latency_runs=1, measure_memory=False), measure_quality=measured)
    assert backbone in report["latency"]
    if measured:
        assert report["quality"]["backbone_sqnr_db"] and report["quality"]["probe_psnr_db"] is not None
    if "keep_sensitive" in options:  # measured on the linears, the ones over the share recorded as float
        sens = report["details"]["sensitive_linears"]
        assert sens["ranking_top"] and set(sens["float"]) <= set(report["float_nodes"])
        assert all(r["share"] > 0.1 for r in sens["ranking_top"] if r["node"] in sens["float"])
    if "bias_correction" in options:  # every quantized linear's mean error folded into a bias (added where none)
        bc = report["details"]["bias_correction"]
        assert bc["corrected_linears"] > 0 and bc["rms_channel_mean_error"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["components"][backbone]["precision"] == report["precision"]
    compile_loop(out, out, form="loop")
    pipe = Pipeline.from_folder(out)
    kw = dict(steps=3, sampler=sampler, guidance=4.0, seed=2, batch=2)
    host = pipe("a red circle on the left", **kw)
    loop = pipe("a red circle on the left", loop="loop", **kw)
    assert psnr(loop.images, host.images) >= 60
