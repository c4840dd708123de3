"""`compile-loop`: add a one-graph sampling stage (Loop or unrolled, optionally the whole pipeline)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx

from ..folder.artifacts import (check_external_paths, check_output_folder, component_path, confined, derive,
                                load_component, read_manifest, verify_folder)
from ..errors import UserError
from ..families import get_family
from ..folder.manifest import Component, Manifest
from . import compile_control as loops_control
from ..onnxio.files import INLINE_MAX, write, write_external
from .builder import FORMS, build_sampling_graph

LARGE = INLINE_MAX  # a backbone stored with at least this many bytes is optimized file to file


def component_name(form: str, whole: bool) -> str:
    return f"sampler_{form}" + ("_whole" if whole else "")


def _tensor_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path: Path) -> list[str]:
    """Save inline below 2 GB, else with every weight in one external file beside the model."""
    if _tensor_bytes(model) < INLINE_MAX:
        write(model, path)
        return []
    return [write_external(model, path)]


def _stored_bytes(folder: Path, entry: Component) -> int:
    return sum(confined(folder, rel, "file").stat().st_size for rel in entry.files)


def _ort_optimized_file(path: Path, level, scratch: Path) -> tuple[onnx.ModelProto, Path]:
    """ORT's optimized CPU graph of the backbone stored at `path`, past protobuf's 2 GB limit: ORT loads it
    from its folder and writes the optimized graph with every weight over 1 KB in one external file.
    Returns that graph without its weights (external references) and the weights file."""
    import onnxruntime

    from ..onnxio.session import disabled_for, tool_options as session_options

    out = scratch / "optimized.onnx"
    opts = session_options(1, level, str(out))
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx_data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    opts.add_session_config_entry("session.disable_prepacking", "1")  # never run: no packed copies of the weights
    disabled = [d for d in disabled_for(path) if d == "QDQSelectorActionTransformer"]
    onnxruntime.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
    return onnx.load(str(out), load_external_data=False), scratch / "optimized.onnx_data"


def save_with_weights(model: onnx.ModelProto, path: Path, weights: Path) -> list[str]:
    """Save a graph whose external tensors all live in `weights` (moved beside it as <name>_data); tensors
    over 1 KB it holds in memory (a whole graph's text encoder and VAE) are appended to that file."""
    from ..onnxio.files import all_graphs

    data = path.name + "_data"
    try:
        os.replace(weights, path.parent / data)
    except OSError:
        shutil.copyfile(weights, path.parent / data)
    with open(path.parent / data, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        for g in all_graphs(model.graph):
            for t in g.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    for e in t.external_data:
                        if e.key == "location":
                            e.value = data
                elif len(t.raw_data) > 1024:
                    end += (-end) % 4096
                    f.seek(end)
                    f.write(t.raw_data)
                    t.external_data.add(key="location", value=data)
                    t.external_data.add(key="offset", value=str(end))
                    t.external_data.add(key="length", value=str(len(t.raw_data)))
                    end += len(t.raw_data)
                    t.ClearField("raw_data")
                    t.data_location = onnx.TensorProto.EXTERNAL
    write(model, path)
    return [data]


def _has_qdq(model: onnx.ModelProto) -> bool:
    from ..onnxio.files import all_graphs

    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for g in all_graphs(model.graph) for n in g.node)


def _check_form(form: str, steps: int | None) -> None:
    if form not in FORMS:
        raise UserError(f"unknown loop form {form!r}; choose from {', '.join(FORMS)}")
    if form == "unrolled" and (steps is None or steps < 1):
        raise UserError("--form unrolled needs --steps >= 1")
    if form == "loop" and steps is not None:
        raise UserError("--steps is for --form unrolled; the loop form takes the step count at run time")
    if form == "unrolled" and steps > 1000:
        raise UserError(f"--steps must be in [1, 1000], got {steps}")


def _whole_parts(model: Path, manifest: Manifest, family) -> dict:
    """A whole graph's other parts: the text encoders, the family's combine, the VAE decoder and its scaling."""
    info, comps = manifest.pipeline, manifest.components
    scale, shift = family.decode_scale_shift(info)
    slots = {s.name: s for s in family.text_encoders}
    return dict(
        text_encoders={s.name: (load_component(model, manifest, s.name), s.outputs)
                       for s in family.text_encoders if s.name in comps},
        combine=lambda ops, encoded: family.combine(ops, encoded, info),
        text_outputs=lambda name, ops, outputs, mask: family.text_outputs(ops, slots[name], outputs, mask, info),
        vae_decoder=load_component(model, manifest, "vae_decoder"),
        vae_scaling_factor=1.0 / scale, vae_shift_factor=shift, decode=family.graph_decode(info),
    )


def compile_loop(model: Path | str, out: Path | str, form: str = "loop", steps: int | None = None,
                 whole: bool = False, overwrite: bool = False, backbone: str | None = None,
                 cpu_tuned: bool | None = None, cache: str | None = None, controlnets=(),
                 stop_early: bool = False) -> dict:
    """Write `out`: the model folder plus one graph running the whole sampling loop.

    `out` may equal `model` to add the graph in place. Returns the new component's manifest entry.
    cpu_tuned inlines the graph ONNX Runtime runs on this CPU after all its passes, so the Loop is as
    fast as the host loop; the entry records the target (ORT version, vector width) and a pipeline on
    another target refuses the graph with a one-line error. False stays portable (ORT_ENABLE_EXTENDED,
    ~1.17x the host loop's time for an fp32 UNet). None (default): tuned for a float backbone; an int8
    backbone (Q/DQ, or one whose manifest disables ORT passes) keeps what the host loop runs.
    `cache`: a step-caching spec (or a bare method): the Loop graph can then cache with that method, at an
    interval or threshold chosen per run (generate --cache). `controlnets`: the folder's ControlNets built in.
    `stop_early`: the Loop's cond output tests the denoised estimate's change, so generate --stop-early
    THRESHOLD[:MIN_STEPS] ends it early (techniques/stop.py).
    """
    model, out = Path(model), Path(out)
    _check_form(form, steps)
    cache_spec = _cache_spec(cache, form, whole, stop_early)

    in_place = out.resolve() == model.resolve()
    if not in_place:
        check_output_folder(out, overwrite, inputs=(model,))  # before anything is loaded
    manifest = read_manifest(model)
    verify_folder(model, manifest)
    check_external_paths(model, manifest)  # the output copies every component: all must be clean
    family = get_family(manifest.family)
    if whole and family.whole_refusal:
        raise UserError(f"--whole is not available for {family.name} folders: {family.whole_refusal}")
    control = loops_control.check_names(manifest, controlnets, form, whole, family)
    backbone = backbone or family.backbone
    comps = manifest.components
    if backbone not in comps:
        raise UserError(f"{model}: no '{backbone}' component to loop over")
    _check_techniques(cache_spec, control, comps[backbone])
    t0 = time.time()
    unet_path = component_path(model, manifest, backbone)
    large = _stored_bytes(model, comps[backbone]) >= LARGE
    # a large backbone's graph without its weights (they stay in its folder) to decide the form
    unet = onnx.load(str(unet_path), load_external_data=False) if large else load_component(model, manifest, backbone)
    prefused = None
    tuned_for = None
    qdq = _has_qdq(unet)
    unet = loops_control.cut_backbone(unet, family, control, comps[backbone], large)
    if not large:  # the attention query rows nothing reads dropped, as in the host loop's backbone session
        from ..runtime.dead_queries import without_dead_queries

        without_dead_queries(unet)
    if cpu_tuned is None:  # a backbone that runs without some ORT passes (int8) keeps the graph it runs
        cpu_tuned = not qdq and not comps[backbone].disabled_optimizers
    weights = net_level = None  # a large backbone's optimized weights (one file), the ControlNets' ORT level
    scratch = tempfile.TemporaryDirectory(prefix="onnxdiffusion-loop-")
    if cpu_tuned or qdq:
        # ONNX Runtime optimizes a Loop body less than a standalone graph: no Q/DQ -> integer-kernel
        # fusion, no NCHWc layout rewrite. Inline the graph its CPU provider runs after those passes.
        # EXTENDED stays portable; ALL (cpu_tuned) adds NCHWc blocking tied to this CPU's vector width.
        import onnxruntime

        from ..onnxio.session import ort_optimized

        level = onnxruntime.GraphOptimizationLevel
        level = net_level = level.ORT_ENABLE_ALL if cpu_tuned else level.ORT_ENABLE_EXTENDED
        if large:  # ORT reads the backbone from its folder and writes the optimized graph with external data
            unet, weights = _ort_optimized_file(unet_path, level, Path(scratch.name))
        else:
            unet = ort_optimized(unet, level=level)
        prefused = f"onnxruntime {onnxruntime.__version__} CPU, " + (
            "ORT_ENABLE_ALL (tuned to this CPU; rebuild on another)" if cpu_tuned else "ORT_ENABLE_EXTENDED")
        if cpu_tuned:
            from ..runtime.cpu_target import cpu_target

            tuned_for = cpu_target()
    elif large:  # portable float: the graph as exported, weights and all
        unet = load_component(model, manifest, backbone)
    from ..techniques.correction import read_record as read_correction

    correction = read_correction(comps[backbone])
    schedule = high = None
    if comps[backbone].precision_schedule:
        schedule, high, high_tuned = _high_backbone(model, manifest, backbone, cpu_tuned)
        if high_tuned:
            from ..runtime.cpu_target import cpu_target

            tuned_for = cpu_target()
    techniques = _loop_techniques(cache_spec, stop_early, family, unet, comps[backbone], (schedule, high), large,
                                  control, correction)
    extra = _whole_parts(model, manifest, family) if whole else {}
    mode = "none" if not family.true_cfg(manifest.pipeline) else ("cfg_rescale" if family.cfg_rescale else "cfg")
    inlined = tuple(extra.get("text_encoders", ()))
    techniques += loops_control.graph_control(model, control, net_level, family)
    graph = build_sampling_graph(unet, form, steps, latent_channels=int(manifest.pipeline.latent_channels),
                                 guidance_mode=mode, latent_patch=family.latent_patch, techniques=techniques,
                                 **extra)
    del unet, extra, high, techniques
    from ..techniques.lora import expose_lora_inputs

    # run-time LoRA: the insertion points of the backbone (and a whole graph's text encoders) as graph inputs
    lora = expose_lora_inputs(graph, comps, backbone, inlined)
    name = component_name(form, whole)

    def write_component(root: Path) -> dict:
        folder = root / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        files = save_model(graph, folder / "model.onnx") if weights is None else save_with_weights(
            graph, folder / "model.onnx", weights)
        draft = {
            "path": f"{name}/model.onnx",
            "external_data": [f"{name}/{f}" for f in files],
            "kind": "sampling_graph",
            "form": form,
            "steps": steps,
            "whole": whole,
            "backbone": backbone,
            "precision": comps[backbone].precision or "fp32",
            "prefused": prefused,
            "tuned_for": tuned_for,
            "corrected": correction is not None,
            "scheduled": schedule is not None,
            "bytes": sum(p.stat().st_size for p in folder.iterdir()),
            "compile_seconds": round(time.time() - t0, 2),
        }
        if lora:
            draft["lora"] = lora
        if cache_spec is not None:
            draft["cache"] = cache_spec.record()
        draft.update({"controlnets": list(controlnets)} if control else {})
        if stop_early:
            from ..techniques.stop import compiled_record as stop_record

            draft.update(stop_record())
        return draft

    # out of place, only what the manifest lists (and hashed) is copied: stray files in MODEL are not vouched for
    with derive(model, out, manifest, drop=(name,), overwrite=overwrite, in_place=in_place) as d:
        draft = write_component(d.tmp)
        d.components[name] = draft
    scratch.cleanup()
    return Component.from_dict(name, draft)


def _cache_spec(text: str | None, form: str, whole: bool, stop_early: bool = False):
    """The compiled cache's spec (or None), after both per-step options are checked against the form."""
    from ..techniques.caching import parse_compiled_cache

    if stop_early and (form != "loop" or whole):
        raise UserError("--stop-early builds adaptive stopping into the Loop graph the pipeline runs "
                        "(--form loop, not --whole): an unrolled graph cannot end early")
    spec = parse_compiled_cache(text)
    if spec is not None and (form != "loop" or whole):
        raise UserError("--cache builds step caching into the Loop graph the pipeline runs (--form loop, not --whole)")
    return spec


def _check_techniques(spec, control, entry: Component) -> None:
    """The registry's refusals of what cannot be built into one sampling graph, from the backbone's records
    (before any graph is loaded or optimized)."""
    from ..techniques.registry import check_combination

    check_combination({"cache": spec, "controlnet": bool(control), "precision_schedule": bool(entry.precision_schedule),
                       "lora": bool(entry.lora_targets), "correction": bool(entry.correction)}, "loop", compiled=True)


def _loop_techniques(spec, stop_early: bool, family, backbone: onnx.ModelProto, entry: Component, scheduled, large: bool,
                     control, correction) -> list:
    """The Loop twins compile-loop builds in (what cannot be built into one graph was refused first:
    `_check_techniques`; the builder calls them in the registry's order); step caching's cut is of the graph the Loop inlines
    (ORT's optimized one when tuned), so with nothing cached it runs the same kernels. `scheduled`: (the
    precision schedule, its high-precision backbone) or (None, None)."""
    from ..techniques.correction import CorrectionLoop
    from ..techniques.precision import ScheduleLoop
    from ..techniques.stop import StopLoop

    schedule, high = scheduled
    techniques = []
    if spec is not None:
        if large:
            raise UserError(f"--cache {spec.method}: step caching in the Loop graph does not support a backbone over "
                            "2 GB yet (use --loop host)")
        from ..techniques.caching import cut
        from ..techniques.caching_graph import CacheLoop

        techniques.append(CacheLoop(spec, cut(backbone, family, spec, f"--cache {spec.method}")))
    if stop_early:
        techniques.append(StopLoop())
    if correction is not None:
        techniques.append(CorrectionLoop(correction))
    if schedule is not None:
        techniques.append(ScheduleLoop(schedule, high))
    return techniques


def _high_backbone(model: Path, manifest: Manifest, backbone: str, cpu_tuned: bool | None):
    """The precision schedule of `backbone` and its high-precision backbone as the host loop runs it
    (ORT's optimized CPU graph: fully, tuned to this CPU, unless `cpu_tuned` is False or the component
    disables passes); returns (schedule, model, tuned)."""
    import onnxruntime

    from ..onnxio.session import ort_optimized
    from ..techniques.precision import read_record

    schedule = read_record(manifest.components[backbone])
    high = load_component(model, manifest, schedule.component)
    disabled = manifest.components[schedule.component].disabled_optimizers
    tuned = (cpu_tuned is not False) and not disabled and not _has_qdq(high) and _tensor_bytes(high) < INLINE_MAX
    level = onnxruntime.GraphOptimizationLevel
    if tuned or _tensor_bytes(high) < INLINE_MAX:
        high = ort_optimized(high, level=level.ORT_ENABLE_ALL if tuned else level.ORT_ENABLE_EXTENDED)
    return schedule, high, tuned
