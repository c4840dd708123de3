"""`quantize`: one function, any recipe; a new model folder with the recipe and its provenance."""

from __future__ import annotations

import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import EncodeError

from ..artifacts import (MANIFEST, atomic_dir, check_external_paths, check_output_folder, component_path, confined,
                         hash_tree, link_files, link_or_copy, load_component, read_manifest, sha256_file,
                         verify_folder, write_json)
from ..errors import UserError
from ..families import get_family
from ..runtime.session import check_external_data
from . import _ort, files
from ..relayout import RUNTIME_EXTERNAL_BYTES
from .configs import QuantizeConfig
from .graphs import is_quantized, sort_graph
from .report import REPORT_NAME, SPEEDUP_THRESHOLD, fused_summary, measure_latency
from .runner import disabled_for


class SpeedGateError(UserError):
    """--require-speedup and the recipe is not faster; carries the report for printing."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def _check_out(model: Path, out: Path, overwrite: bool) -> None:
    if out.resolve() == model.resolve():
        raise UserError("OUT must be a new folder, not MODEL itself")
    check_output_folder(out, overwrite, inputs=(model,))


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
    from ..runtime import Pipeline
    from ..runtime.session import resolve_provider
    from .calibration import capture, load_prompts, naive_set
    from .configs import Int8NaiveRecipe, MixedRecipe
    from .correction import OutputCorrection, affine_explained_fraction
    from .recipes import BUILDERS, SKELETON_RECIPES, Context, evaluate_sqnr, prepare_unet
    from .runner import ImageProbe

    log = log or (lambda m: None)
    model, out = Path(model), Path(out)
    t_start = time.time()
    recipe = config.recipe
    resolve_provider(config.provider)  # installed?
    if config.correct and not measure_quality:
        raise UserError("--correct is fitted on the quality measurement's fp32 trajectories; it needs --quality")
    _check_out(model, out, overwrite)  # before anything is loaded
    manifest = read_manifest(model)
    verify_folder(model, manifest)
    check_external_paths(model, manifest)  # the output copies every component: all must be clean
    comps = manifest["components"]
    if manifest.get("quantization") and not force:
        q = manifest["quantization"]
        prev = q if isinstance(q, str) else str((q.get("config") or {}).get("recipe", {}).get("name", "?"))
        raise UserError(f"{model} is already quantized (recipe {prev}); quantize the fp32 folder, or pass --force")
    # recipes call the backbone "unet" whatever the family; the folder names it as its family does
    backbone = get_family(manifest.get("family")).backbone

    def folder_name(name: str) -> str:
        return backbone if name == "unet" else name

    unet_path = component_path(model, manifest, backbone)
    check_external_data(unet_path)
    unet = files.load_backbone(unet_path)  # past the inline limit: a skeleton, weights left in their file
    large = files.data_dir(unet) is not None
    if large and not isinstance(recipe, SKELETON_RECIPES):
        unet = files.with_weights(unet)
    if is_quantized(unet) and not force:
        raise UserError(f"{model}: the backbone is already quantized; quantize the fp32 folder, or pass --force")
    prompts, prompt_source = load_prompts(config.calibration)
    wanted = set(getattr(recipe, "components", ("unet",)))
    for name in wanted - {"unet"}:
        if name not in comps:
            raise UserError(f"{model}: no '{name}' component to convert")

    pipe = Pipeline.from_folder(model, provider="cpu", verify=False, threads=config.threads)
    pipe.backbone  # its session now: a graph ONNX Runtime refuses is one line here, not a crash mid-quantize
    pipe.correction = pipe.precision_schedule = None  # (a forced re-quantization) references are the plain backbone's
    cache: dict = {}

    def get_calibration():
        if "calib" not in cache:
            if isinstance(recipe, Int8NaiveRecipe):
                cache["calib"] = naive_set(pipe, recipe, config.calibration.seed)
            else:
                log(f"capturing fp32 trajectories: {len(prompts)} prompts x {config.calibration.steps} {config.calibration.sampler} steps")
                cache["calib"] = capture(pipe, prompts, config.calibration)
                cache["calib"].provenance["prompt_source"] = prompt_source
        return cache["calib"]

    def get_trajectories():
        """fp32 runs over the calibration prompts: calibration data for calibrated recipes, and for
        every recipe the reference its backbone error (and --correct) is measured against."""
        if recipe.calibrated:
            return get_calibration()
        if "traj" not in cache:
            cache["traj"] = capture(pipe, prompts, config.calibration)
            cache["traj"].provenance["prompt_source"] = prompt_source
        return cache["traj"]

    def get_probe():
        if "probe" not in cache:
            n = getattr(recipe, "probe_prompts", 8)
            cal = config.calibration
            cache["probe"] = ImageProbe(pipe, prompts[:n], cal.seed, cal.steps, cal.sampler, cal.guidance, config.threads)
        return cache["probe"]

    others = {name: load_component(model, manifest, name) for name in wanted - {"unet"}}
    def component_feeds(name: str) -> list[dict]:
        from .components import calibration_feeds

        return calibration_feeds(pipe, name, get_calibration(), prompts)

    ctx = Context(config, prepare_unet(unet), others, get_calibration, get_probe, log, component_feeds)
    if large:
        # everything the fp32 backbone must run for comes first; then its session (the size of the
        # weights) is let go, so the quantizer's copy of the weights is the only one held
        if measure_quality:
            get_trajectories()
        if measure_quality or isinstance(recipe, MixedRecipe) or getattr(recipe, "searches", False):  # searches run the probe
            get_probe()
        if recipe.calibrated:
            get_calibration()
        if config.schedule is None:  # a precision schedule runs the fp32 pipeline again to choose its steps
            pipe.backbone = None
            _release_memory()
    log(f"building {recipe.name}")
    try:
        built = BUILDERS[type(recipe)](ctx, recipe)
    except (EncodeError, ValueError) as e:
        if isinstance(e, ValueError) and "2GB" not in str(e):  # onnx's own size check says "2GB"
            raise
        raise UserError(f"recipe {recipe.name}: a model past protobuf's 2 GB limit could not be serialized ({e}); "
                        f"this recipe does not support backbones of {files.tensor_bytes(unet) / 1e9:.2f} GB") from None
    for m in built.components.values():
        sort_graph(m)
    new_unet = built.components.get("unet")
    # what ORT's CPU provider runs to measure quality: the stored backbone, or its fp32 simulation
    # when the stored form has no CPU kernels (NVFP4); None when neither runs here
    measured = built.simulation if built.simulation is not None else (new_unet if built.cpu_runnable else None)

    quality: dict = {}
    correction = None
    traj = get_trajectories() if measured is not None and measure_quality else None
    if traj is not None:
        sq = evaluate_sqnr(measured, traj, config.threads)
        quality["backbone_sqnr_db"] = {k: v for k, v in sq.items() if k != "_outputs"}
        if config.correct:
            if config.correct_method == "output":
                correction = OutputCorrection.fit(traj.timesteps, traj.outputs, sq["_outputs"])
            else:
                from ..runtime.pipeline import GenerateOptions
                from .runner import session as _session

                qsess = _session(measured, config.threads)
                table = pipe.table(GenerateOptions(steps=config.calibration.steps, sampler=config.calibration.sampler))
                correction = OutputCorrection.fit_trajectory(lambda feed: qsess.run(["out_sample"], feed)[0], traj, table)
            corrected = np.stack([correction.apply(sq["_outputs"][s], traj.timesteps[s]) for s in range(traj.num_steps)])
            from .runner import sqnr_db

            quality["backbone_sqnr_corrected_db"] = sqnr_db(traj.outputs, corrected)
            quality["backbone_error_affine_fraction"] = affine_explained_fraction(traj.outputs, sq["_outputs"])
        probe = get_probe()
        from .runner import session

        quality["probe_psnr_db"] = probe.psnr(session(measured, config.threads))
        if correction is not None:
            pipe.correction = correction
            try:
                quality["probe_psnr_corrected_db"] = probe.psnr(session(measured, config.threads))
            finally:
                pipe.correction = None
        quality["probe"] = {"prompts": len(probe.prompts), "note": "calibration prompts, not held-out"}
        if measured is not new_unet:
            quality["measured_on"] = built.details.get("quality_measured_on", "fp32 simulation")

    schedule, schedule_report, high_model = None, None, None
    if config.schedule is not None:
        if measured is None:
            raise UserError(f"--precision-schedule: the {recipe.name} backbone does not run here, so no step can be measured")
        from .schedule_select import choose

        high_model = unet_path if config.schedule.precision == "fp32" else _ort.fp16_convert(ctx.unet, ())
        schedule, schedule_report = choose(pipe, measured, high_model, config, prompts, manifest,
                                           folder_name("unet") + "_high", log)
        if schedule is None:
            log("precision schedule: no set of steps closed any of the quantized backbone's image error; none stored")

    runnable = built.cpu_runnable or config.provider != "cpu"
    log("measuring latency" if runnable else "latency not measured: the stored backbone has no kernels on this provider")
    latency = measure_latency(model, manifest, {folder_name(k): v for k, v in built.components.items()}, config) if runnable else {}
    sizes = {}
    for name, m in built.components.items():
        before = comps[folder_name(name)]["bytes"]
        after = files.model_bytes(m)
        sizes[name] = {"fp32_bytes": before, "bytes": after, "ratio": round(before / after, 3)}
    fused = fused_summary(new_unet, config.threads) if new_unet is not None and config.provider == "cpu" and runnable else None
    memory = None
    if new_unet is not None and config.measure_memory and runnable:
        from .report import component_feed
        from .runner import memory_mb

        with tempfile.TemporaryDirectory(prefix="onnxdiffusion-q-") as scratch:
            path = Path(scratch) / "unet.onnx"
            files.save(new_unet, path)
            feed = component_feed(backbone, manifest)
            memory = {"fp32": memory_mb(unet_path, feed), "new": memory_mb(path, feed),
                      "note": "resident MB a fresh process gains loading the backbone (and after one call)"}
    gate_key = backbone if backbone in latency else None
    ratio = latency[gate_key]["ratio"] if gate_key else sum(v["median_ms"] for v in latency.values()) / max(
        sum(v["fp32_median_ms"] for v in latency.values()), 1e-9) if latency else None
    pays = ratio is not None and ratio <= SPEEDUP_THRESHOLD
    verdict = f"pays on {config.provider}: {1 / ratio:.2f}x faster" if pays else f"does not pay on {config.provider}"
    if ratio is not None and ratio > 1.0:
        verdict += f": SLOWER than fp32 ({ratio:.2f}x its backbone latency)"
    if ratio is None:
        verdict = f"not measured on {config.provider}: {built.details.get('stored_as', 'no kernels here')}"
    elif built.details.get("simulated_on_cpu") and config.provider == "cpu":
        verdict += " (FP8 Q/DQ runs as float simulation on ONNX Runtime's CPU provider; the speed is TensorRT's to give)"
    report = {
        "recipe": recipe.to_dict(),
        "source": str(model),
        "output": str(out),
        "precision": built.precision,
        "provider": config.provider,
        "threads": config.threads,
        "sizes": sizes,
        "latency": latency,
        "latency_ratio": round(ratio, 3) if ratio is not None else None,
        "pays": pays,
        "verdict": verdict,
        "quality": quality,
        "float_nodes": built.float_nodes,
        "float_node_count": len(built.float_nodes),
        "quantized_node_count": len(built.quantized_nodes),
        "fused_ops": fused,
        "memory": memory,
        "details": built.details,
        "correction": correction.to_dict() if correction else None,
        "precision_schedule": schedule_report,
        "seconds": None,
    }
    if require_speedup and not pays:
        report["seconds"] = round(time.time() - t_start, 1)
        measured_ratio = "not measurable here" if ratio is None else f"{ratio:.2f}x fp32"
        raise SpeedGateError(f"{recipe.name} does not pay on {config.provider}: backbone latency {measured_ratio} "
                             f"(--require-speedup)", report)

    calib = cache.get("calib")
    provenance = dict(calib.provenance) if calib is not None else {"kind": "none"}
    if correction is not None:
        provenance["correction_fitted_on"] = {k: traj.provenance[k] for k in ("kind", "prompts", "seeds", "sampler", "steps", "guidance")}
    replaced = set(built.components)
    replaced = {folder_name(n) for n in replaced}
    skip = {comps[n]["path"] for n in replaced} | {p for n in replaced for p in comps[n].get("external_data", [])}
    skip_dirs = {info["path"].split("/")[0] for n, info in comps.items() if info.get("kind") == "sampling_graph"}
    with atomic_dir(out, overwrite=overwrite, inputs=(model,)) as tmp:
        link_files(model, tmp, [rel for rel in manifest["files"] if rel not in skip and rel.split("/")[0] not in skip_dirs])
        new_manifest = json.loads(json.dumps(manifest))
        for n in list(new_manifest["components"]):
            if new_manifest["components"][n].get("kind") == "sampling_graph":
                del new_manifest["components"][n]
        for name, m in built.components.items():
            info = new_manifest["components"][folder_name(name)]
            rel = Path(info["path"])
            (tmp / rel.parent).mkdir(parents=True, exist_ok=True)
            # weights in a file beside the graph from RUNTIME_EXTERNAL_BYTES: ORT keeps inline ones twice
            data = files.save(m, tmp / rel, keep=False, external_from=RUNTIME_EXTERNAL_BYTES)  # m not read after
            info["external_data"] = [str(rel.parent / f) for f in data]
            info["precision"] = built.precision
            info["bytes"] = sum((tmp / rel.parent / f).stat().st_size for f in [rel.name, *data])
            info["quantized_from"] = {"sha256": manifest["files"].get(info["path"])}
            info.pop("validation", None)
            disabled = disabled_for(m)  # every int8 component: the pipeline honours it
            if disabled:
                info["session_options"] = {"disabled_optimizers": list(disabled)}
            else:
                info.pop("session_options", None)
            if name == "unet":
                info["float_nodes"] = len(built.float_nodes)
                if correction is not None:
                    info["correction"] = correction.to_dict()
                if "stored_as" in built.details:  # a provider-specific graph, not portable QDQ
                    info["stored_as"] = built.details["stored_as"]
                if "int8_kernels" in built.details:  # the CPU its convolutions were laid out for (checked at load)
                    info["int8_kernels"] = built.details["int8_kernels"]
                if "requires_provider" in built.details:
                    info["requires_provider"] = built.details["requires_provider"]
                if "boundaries" in built.details:
                    info["timestep_groups"] = {"boundaries": built.details["boundaries"],
                                               "groups": built.details["groups"]}
        if schedule is not None:
            _write_high(tmp, model, comps[backbone], new_manifest, schedule, high_model)
            new_manifest["components"][backbone]["precision_schedule"] = schedule.to_dict()
        new_manifest["quantization"] = {
            "config": config.to_dict(),
            "calibration": provenance,
            "float_nodes": built.float_nodes,
            "source": {"folder": str(model.resolve()), "unet_sha256": sha256_file(unet_path)},
            "tool_versions": {"onnxruntime": _ort.version(), "onnx": onnx.__version__},
        }
        report["seconds"] = round(time.time() - t_start, 1)
        write_json(tmp / REPORT_NAME, _jsonable(report))
        new_manifest["files"] = hash_tree(tmp)
        write_json(tmp / MANIFEST, new_manifest)
    return report


def _write_high(tmp: Path, model: Path, src: dict, new_manifest: dict, schedule, high_model) -> None:
    """The precision schedule's high-precision backbone as its own component: the source's files
    (linked) for fp32, the converted model for fp16."""
    name = schedule.component
    info = json.loads(json.dumps(src))
    info["path"] = f"{name}/{Path(src['path']).name}"
    (tmp / name).mkdir(parents=True, exist_ok=True)
    if isinstance(high_model, onnx.ModelProto):
        data = files.save(high_model, tmp / info["path"], external_from=RUNTIME_EXTERNAL_BYTES)
        info["external_data"] = [f"{name}/{f}" for f in data]
        info.pop("validation", None)
    else:
        info["external_data"] = [f"{name}/{Path(rel).name}" for rel in src.get("external_data", [])]
        for a, b in zip([src["path"], *src.get("external_data", [])], [info["path"], *info["external_data"]]):
            link_or_copy(confined(model, a, "file"), confined(tmp, b, "file"))
    info["precision"] = schedule.precision
    info["role"] = "precision_schedule_high"
    info["bytes"] = sum((tmp / rel).stat().st_size for rel in [info["path"], *info["external_data"]])
    new_manifest["components"][name] = info


def _release_memory() -> None:
    """Collect, and hand freed heap back to the OS (glibc), so the next multi-GB allocation does not stack on it."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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

