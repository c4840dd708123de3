"""`--latency auto | on | off` (quantize/speed_plan.py): the fp32-vs-new latency pair, the fused-op count and the
memory figure are measured only where asked (auto: where the machine can hold the fp32 backbone), the setting is
recorded, and a report that measured nothing says "not measured" and why instead of a verdict."""

import json

import onnx
import onnxruntime as ort
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.onnxio import files as onnxio_files
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class
from onnxdiffusion.quantize import speed_plan as sp
from onnxdiffusion.quantize.options import QuantizeOptions

GB = 10**9
FAST = dict(calibration=CalibrationConfig(count=4, steps=3, batch=4), latency_runs=1, measure_memory=True)


def test_auto_measures_what_the_machine_holds_and_says_why_not_past_it():
    assert sp.speed_plan("auto", 3 * GB, memory=24 * GB).measure
    big = sp.speed_plan("auto", int(15.5 * GB), memory=24 * GB)
    assert not big.measure and "15.5 GB" in big.why and "24.0 GB" in big.why
    assert sp.speed_plan("on", 100 * GB, memory=24 * GB).measure
    off = sp.speed_plan("off", 1, memory=24 * GB)
    assert not off.measure and off.why.startswith("--latency off")
    assert off.to_dict() == {"setting": "off", "measured": False, "why": off.why}
    with pytest.raises(UserError, match="--latency must be"):
        sp.speed_plan("sometimes", 1)


def test_the_setting_is_in_the_config_only_when_not_auto():
    recipe = recipe_class("int8-dynamic")()
    assert "latency" not in QuantizeConfig(recipe=recipe).to_dict()  # folders made before it keep their bytes
    d = QuantizeConfig(recipe=recipe, latency="off").to_dict()
    assert d["latency"] == "off" and QuantizeConfig.from_dict(d).latency == "off"
    with pytest.raises(UserError, match="latency must be one of"):
        QuantizeConfig(recipe=recipe, latency="never")



def test_the_verb_option_reaches_the_config(tiny_onnx):
    assert QuantizeOptions(recipe="int8-dynamic", latency="off").config(tiny_onnx).latency == "off"
    assert QuantizeOptions(recipe="int8-dynamic").config(tiny_onnx).latency == "auto"


def _backbone_sessions(monkeypatch) -> list:
    """Every ORT session opened on a graph with a `timestep` input (the backbone, fp32 or quantized)."""
    opened, real = [], ort.InferenceSession.__init__

    def init(self, model, *a, **kw):
        graph = (onnx.load(model, load_external_data=False) if isinstance(model, str)
                 else onnx.load_from_string(model)).graph
        if any(i.name == "timestep" for i in graph.input):
            opened.append(model if isinstance(model, str) else "<bytes>")
        return real(self, model, *a, **kw)

    monkeypatch.setattr(ort.InferenceSession, "__init__", init)
    return opened


@pytest.mark.slow
def test_off_records_the_setting_and_reports_not_measured(tiny_onnx, tmp_path):
    config = QuantizeConfig(recipe=recipe_class("int8-dynamic")(), latency="off", **FAST)
    report = quantize(tiny_onnx, tmp_path / "q", config, measure_quality=False)
    assert report["latency"] == {} and report["latency_ratio"] is None and not report["pays"]
    assert report["verdict"].startswith("not measured on cpu: --latency off")
    assert report["fused_ops"] is None and report["memory"] is None
    assert report["latency_pair"] == {"setting": "off", "measured": False, "why": report["latency_pair"]["why"]}
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["quantization"]["config"]["latency"] == "off"
    with pytest.raises(UserError, match="--require-speedup gates on the measured latency"):
        quantize(tiny_onnx, tmp_path / "gated", config, require_speedup=True, measure_quality=False)
    assert not (tmp_path / "gated").exists()


@pytest.mark.slow
def test_a_backbone_too_large_to_time_gets_no_session_at_all(external_onnx, tmp_path, monkeypatch):
    """int8-dynamic without quality on a backbone past the inline limit and the machine's share: no session of the
    backbone is opened (not the fp32 one calibration used to open, not the latency pair)."""
    monkeypatch.setattr(onnxio_files, "INLINE_LIMIT", 64 << 10)
    monkeypatch.setattr(sp, "physical_memory", lambda: 1 << 20)  # a "machine" smaller than the tiny UNet
    opened = _backbone_sessions(monkeypatch)
    report = quantize(external_onnx, tmp_path / "q", QuantizeConfig(recipe=recipe_class("int8-dynamic")(), **FAST),
                      measure_quality=False)
    assert opened == []
    assert report["latency_pair"]["setting"] == "auto" and not report["latency_pair"]["measured"]
    assert "too large to time" in report["verdict"] and report["latency"] == {}
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert "latency" not in manifest["quantization"]["config"]
    # the same folder with the pair on: both sessions, a ratio, a verdict
    opened.clear()
    report = quantize(external_onnx, tmp_path / "on", QuantizeConfig(recipe=recipe_class("int8-dynamic")(),
                                                                     latency="on", **FAST), measure_quality=False)
    assert len(opened) >= 2 and report["latency_ratio"] is not None and report["latency_pair"]["measured"]
