"""`quantize`'s measure stage: the new backbone's quality against fp32 (and the --correct fit), the
precision schedule's steps, latency, sizes, fused ops and memory. Each part takes what the earlier
stages made and returns a typed result."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..errors import UserError
from . import _ort, files
from .configs import QuantizeConfig
from .report import component_feed, fused_summary, measure_latency


@dataclass
class Quality:
    numbers: dict = field(default_factory=dict)  # the report's "quality"
    correction: object | None = None  # correction.OutputCorrection fitted under --correct
    trajectories: object | None = None  # the fp32 runs it was measured on (their provenance is recorded)


@dataclass
class Schedule:
    schedule: object | None = None  # schedule.PrecisionSchedule, None when none was chosen
    report: dict | None = None
    high_model: onnx.ModelProto | Path | None = None  # the high-precision backbone: the source's file or fp16


@dataclass
class Speed:
    latency: dict
    sizes: dict
    fused: dict | None
    memory: dict | None
    runnable: bool
    not_measured: str | None = None  # why latency, fused ops and memory were not measured (a runnable backbone)


@dataclass
class Measured:
    quality: Quality
    schedule: Schedule
    speed: Speed


def measured_graph(built) -> onnx.ModelProto | None:
    """What ORT's CPU provider runs to measure quality: the stored backbone, or its fp32 simulation
    when the stored form has no CPU kernels (NVFP4); None when neither runs here."""
    if built.simulation is not None:
        return built.simulation
    return built.backbone if built.cpu_runnable else None


def measure_quality(built, data, config: QuantizeConfig, measure: bool) -> Quality:
    from .correction import OutputCorrection, affine_explained_fraction
    from .recipes import evaluate_sqnr
    from .runner import session, sqnr_db

    measured = measured_graph(built)
    traj = data.trajectories() if measured is not None and measure else None
    if traj is None:
        return Quality()
    quality: dict = {}
    correction = None
    # one session of the measured graph for the SQNR, the correction's fit and the probe images: the same bytes and
    # options each time (a session's runs do not change it), opened once instead of up to four times
    qsess = session(measured, config.threads)
    sq = evaluate_sqnr(qsess, traj, config.threads)
    quality["backbone_sqnr_db"] = {k: v for k, v in sq.items() if k != "_outputs"}
    if config.correct:
        if config.correct_method == "output":
            correction = OutputCorrection.fit(traj.timesteps, traj.outputs, sq["_outputs"])
        else:
            from ..runtime.pipeline import GenerateOptions

            table = data.pipe.table(GenerateOptions(steps=config.calibration.steps, sampler=config.calibration.sampler))
            correction = OutputCorrection.fit_trajectory(lambda feed: qsess.run(["out_sample"], feed)[0], traj, table)
        corrected = np.stack([correction.apply(sq["_outputs"][s], traj.timesteps[s]) for s in range(traj.num_steps)])
        quality["backbone_sqnr_corrected_db"] = sqnr_db(traj.outputs, corrected)
        quality["backbone_error_affine_fraction"] = affine_explained_fraction(traj.outputs, sq["_outputs"])
    probe = data.probe()
    quality["probe_psnr_db"] = probe.psnr(qsess)
    if correction is not None:
        data.pipe.correction = correction
        try:
            quality["probe_psnr_corrected_db"] = probe.psnr(qsess)
        finally:
            data.pipe.correction = None
    quality["probe"] = {"prompts": len(probe.prompts), "note": "calibration prompts, not held-out"}
    if measured is not built.backbone:
        quality["measured_on"] = built.quality_measured_on or "fp32 simulation"
    return Quality(quality, correction, traj)


def choose_schedule(source, data, ctx, built, config: QuantizeConfig, log) -> Schedule:
    if config.schedule is None:
        return Schedule()
    measured = measured_graph(built)
    if measured is None:
        raise UserError(f"--precision-schedule: the {config.recipe.name} backbone does not run here, so no step can be measured")
    from .schedule_select import choose

    high = source.backbone_path if config.schedule.precision == "fp32" else _ort.fp16_convert(ctx.unet, ())
    schedule, report = choose(data.pipe, measured, high, config, data.prompts, source.manifest,
                              source.backbone_name + "_high", log)
    if schedule is None:
        log("precision schedule: no set of steps closed any of the quantized backbone's image error; none stored")
    return Schedule(schedule, report, high)


def measure_speed(source, built, config: QuantizeConfig, log) -> Speed:
    runnable = built.cpu_runnable or config.provider != "cpu"
    timed = runnable and source.speed.measure  # each part below opens a session of the backbone
    if not runnable:
        log("latency not measured: the stored backbone has no kernels on this provider")
    elif not timed:
        log(f"latency not measured: {source.speed.why}")
    else:
        log("measuring latency")
    named = {source.folder_name(k): v for k, v in built.components.items()}
    latency = measure_latency(source.folder, source.manifest, named, config) if timed else {}
    sizes = {}
    for name, m in built.components.items():
        before = source.components[source.folder_name(name)].bytes
        after = files.model_bytes(m)
        sizes[name] = {"fp32_bytes": before, "bytes": after, "ratio": round(before / after, 3)}
    new = built.backbone
    fused = fused_summary(new, config.threads) if new is not None and config.provider == "cpu" and timed else None
    memory = None
    if new is not None and config.measure_memory and timed:
        from .runner import memory_mb

        with tempfile.TemporaryDirectory(prefix="onnxdiffusion-q-") as scratch:
            path = Path(scratch) / "backbone.onnx"
            # a skeleton (a streamed build) saved with keep would point at this scratch folder, gone when it ends
            files.save(files.copy(new) if files.data_dir(new) is not None else new, path)
            feed = component_feed(source.backbone_name, source.manifest)
            memory = {"fp32": memory_mb(source.backbone_path, feed), "new": memory_mb(path, feed),
                      "note": "resident MB a fresh process gains loading the backbone (and after one call)"}
    return Speed(latency, sizes, fused, memory, runnable, None if timed or not runnable else source.speed.why)


def measure(source, data, ctx, built, config: QuantizeConfig, measure: bool, log) -> Measured:
    quality = measure_quality(built, data, config, measure)
    schedule = choose_schedule(source, data, ctx, built, config, log)
    return Measured(quality, schedule, measure_speed(source, built, config, log))

