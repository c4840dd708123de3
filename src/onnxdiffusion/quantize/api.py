"""`quantize`: one function, any recipe; a new model folder with the recipe and its provenance.

It reads as its stages: open -> calibrate -> plan -> build (stages.py) -> measure (measure.py) ->
report -> save (here)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from ..folder import tempfiles
from ..folder.artifacts import derive, sha256_file, write_json
from ..errors import UserError
from ..folder.manifest import Component
from ..folder.relayout import RUNTIME_EXTERNAL_BYTES
from . import _ort
from .configs import BACKBONE, QuantizeConfig
from .report import REPORT_NAME, SPEEDUP_THRESHOLD
from .runner import disabled_for
from .stages import build, calibrate, open_source, plan
from .streamed import spill_folders


class SpeedGateError(UserError):
    """--require-speedup and the recipe is not faster; carries the report for printing."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quantize(model: Path | str, out: Path | str, config: QuantizeConfig, overwrite: bool = False, force: bool = False,
             require_speedup: bool = False, log=None, measure_quality: bool = True) -> dict:
    """Write `out`: `model`'s folder with quantized components, the recipe and calibration provenance
    in its manifest, and quantize_report.json. Returns the report.

    Every input is checked before any model runs; nothing is left at `out` on failure (including a
    failed speed gate under `require_speedup`).
    measure_quality False: no backbone SQNR or probe images (the report's quality stays empty; for
    random-weight full-size models, where quality means nothing and each fp32 image costs minutes).
    """
    from .measure import measure

    log = log or (lambda m: None)
    model, out = Path(model), Path(out)
    t_start = time.time()
    source = open_source(model, out, config, overwrite, force, measure_quality, require_speedup)
    data = calibrate(source, config, log, measure_quality)
    ctx = plan(source, data, config, log, measure_quality)
    built = build(ctx, source)
    spills = spill_folders(built.components.values())  # a streamed build's weights: gone once saved (or on failure)
    try:
        measured = measure(source, data, ctx, built, config, measure_quality, log)
        report = make_report(source, out, config, built, measured)
        if require_speedup and not report["pays"]:
            report["seconds"] = round(time.time() - t_start, 1)
            ratio = report["latency_ratio"]
            measured_ratio = "not measurable here" if ratio is None else f"{ratio:.2f}x fp32"
            raise SpeedGateError(f"{config.recipe.name} does not pay on {config.provider}: backbone latency "
                                 f"{measured_ratio} (--require-speedup)", report)
        save(source, out, config, built, measured, data.provenance(), report, overwrite, t_start)
    finally:
        for folder in spills:
            tempfiles.remove(folder)
    return report


# --- report ----------------------------------------------------------------------------------

def verdict(source, built, latency: dict, provider: str,
            not_measured: str | None = None) -> tuple[float | None, bool, str]:
    """The backbone's latency ratio to fp32 (all components' when the backbone was not timed), whether
    it pays (the speed gate), and the sentence that says so (`not_measured`: why nothing was timed)."""
    gate_key = source.backbone_name if source.backbone_name in latency else None
    ratio = latency[gate_key]["ratio"] if gate_key else sum(v["median_ms"] for v in latency.values()) / max(
        sum(v["fp32_median_ms"] for v in latency.values()), 1e-9) if latency else None
    pays = ratio is not None and ratio <= SPEEDUP_THRESHOLD
    text = f"pays on {provider}: {1 / ratio:.2f}x faster" if pays else f"does not pay on {provider}"
    if ratio is not None and ratio > 1.0:
        text += f": SLOWER than fp32 ({ratio:.2f}x its backbone latency)"
    if ratio is None:
        text = f"not measured on {provider}: {not_measured or built.stored_as or 'no kernels here'}"
    elif built.simulated_on_cpu and provider == "cpu":
        text += " (FP8 Q/DQ runs as float simulation on ONNX Runtime's CPU provider; the speed is TensorRT's to give)"
    return ratio, pays, text


def make_report(source, out: Path, config: QuantizeConfig, built, measured) -> dict:
    speed, correction = measured.speed, measured.quality.correction
    ratio, pays, text = verdict(source, built, speed.latency, config.provider, speed.not_measured)
    return {
        "recipe": config.recipe.to_dict(),
        "source": str(source.folder),
        "output": str(out),
        "precision": built.precision,
        "provider": config.provider,
        "threads": config.threads,
        "sizes": speed.sizes,
        "latency": speed.latency,
        "latency_ratio": round(ratio, 3) if ratio is not None else None,
        "pays": pays,
        "verdict": text,
        "quality": measured.quality.numbers,
        "float_nodes": built.float_nodes,
        "float_node_count": len(built.float_nodes),
        "quantized_node_count": len(built.quantized_nodes),
        "fused_ops": speed.fused,
        "memory": speed.memory,
        "details": built.report_details(),
        "correction": correction.to_dict() if correction else None,
        "precision_schedule": measured.schedule.report,
        "latency_pair": source.speed.to_dict(),
        "seconds": None,
    }


# --- save ------------------------------------------------------------------------------------

def _component_entry(draft: dict, source, name: str, model: onnx.ModelProto, built, correction) -> None:
    """What the manifest says about a new component (its files were just written)."""
    draft["precision"] = built.precision
    draft["quantized_from"] = {"sha256": source.manifest.files.get(draft["path"])}
    draft.pop("validation", None)
    disabled = disabled_for(model)  # every int8 component: the pipeline honours it
    if disabled:
        draft["session_options"] = {"disabled_optimizers": list(disabled)}
    else:
        draft.pop("session_options", None)
    if name != BACKBONE:
        return
    draft["float_nodes"] = len(built.float_nodes)
    if correction is not None:
        draft["correction"] = correction.to_dict()
    if built.stored_as is not None:  # a provider-specific graph, not portable QDQ
        draft["stored_as"] = built.stored_as
    if "int8_kernels" in built.details:  # the CPU its convolutions were laid out for (checked at load)
        draft["int8_kernels"] = built.details["int8_kernels"]
    if built.requires_provider is not None:
        draft["requires_provider"] = built.requires_provider
    if built.timestep_groups is not None:
        draft["timestep_groups"] = {"boundaries": built.timestep_groups["boundaries"],
                                   "groups": built.timestep_groups["groups"]}


def save(source, out: Path, config: QuantizeConfig, built, measured, provenance: dict, report: dict, overwrite: bool,
         t_start: float) -> None:
    """The new folder: the source's files linked, the new components saved over theirs (loop graphs
    dropped: they inline the old backbone), the schedule's high backbone beside, the manifest's record."""
    quality, schedule = measured.quality, measured.schedule
    replaced = [source.folder_name(n) for n in built.components]
    with derive(source.folder, out, source.manifest, replace=replaced, drop_kinds=("sampling_graph",),
                overwrite=overwrite) as d:
        for name, m in built.components.items():
            # weights in a file beside the graph from RUNTIME_EXTERNAL_BYTES: ORT keeps inline ones twice
            draft = d.save_component(source.folder_name(name), m, RUNTIME_EXTERNAL_BYTES)  # m not read after
            _component_entry(draft, source, name, m, built, quality.correction)
        if schedule.schedule is not None:
            write_high(d, source.components[source.backbone_name], schedule.schedule, schedule.high_model)
            d.components[source.backbone_name]["precision_schedule"] = schedule.schedule.to_dict()
        if quality.correction is not None:
            provenance["correction_fitted_on"] = {k: quality.trajectories.provenance[k]
                                                  for k in ("kind", "prompts", "seeds", "sampler", "steps", "guidance")}
        d.draft["quantization"] = {
            "config": config.to_dict(),
            "calibration": provenance,
            "float_nodes": built.float_nodes,
            "source": {"folder": str(source.folder.resolve()), "unet_sha256": sha256_file(source.backbone_path)},
            "tool_versions": {"onnxruntime": _ort.version(), "onnx": onnx.__version__},
        }
        report["seconds"] = round(time.time() - t_start, 1)
        write_json(d.tmp / REPORT_NAME, _jsonable(report))


def write_high(d, src: Component, schedule, high_model) -> None:
    """The precision schedule's high-precision backbone as its own component: the source's files
    (linked) for fp32, the converted model for fp16."""
    name = schedule.component
    if isinstance(high_model, onnx.ModelProto):
        draft = src.to_dict()
        draft.pop("validation", None)  # of the fp32 export, not of this conversion
        d.components[name] = draft
        d.save_component(name, high_model, RUNTIME_EXTERNAL_BYTES, rel=f"{name}/{Path(src.path).name}")
    else:
        d.link_component(name, src, name)
    draft = d.components[name]
    draft["precision"] = schedule.precision
    draft["role"] = "precision_schedule_high"
    draft["bytes"] = d.stored_bytes(draft)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
