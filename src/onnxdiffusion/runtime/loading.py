"""Loading a model folder's sessions: which ORT optimizers a component asks to leave off, the
backbone's session and the remedies a quantized one brings along, the scheduler config."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError
from ..folder.manifest import Component, check_scheduler_config, confined
from ..samplers import schedule_from_config
from . import guards
from .session import make_session


def disabled(entry: Component) -> list | None:
    """ORT optimizers a (quantized) component's manifest entry asks to leave off (see _backbone_session)."""
    return entry.disabled_optimizers


def backbone_session(path: Path, entry: Component, provider: str, threads: int | None, providers: list | None = None,
                      memory=None, checked: bool = False, external_files: dict | None = None, model: bytes | None = None):
    """The backbone's session; a quantized backbone may name ORT optimizers to leave off.

    int8 backbones disable the NCHWc/NHWC layout rewrites: the NHWC one wraps every QLinearConv in
    transposes (slower on CPU), and NCHWc changes float convolutions' summation order, which made
    the host loop and the Loop form (where ORT does not apply it) round differently. `model`: the graph as
    rewritten for a provider (onnxio.attention.openvino_form), loaded instead of the file.
    """
    return make_session(path, provider, threads, disabled_optimizers=disabled(entry), providers=providers,
                        memory=memory, checked=checked, model=model if model is not None else _without_dead_queries(path),
                        external_files=external_files)


def _without_dead_queries(path: Path) -> bytes | None:
    """The backbone with the attention query rows nothing reads dropped (runtime.dead_queries: an MMDiT's last
    block), when it has any and its weights are inside the file; else None (the file is loaded as it is)."""
    import onnx

    from .dead_queries import without_dead_queries

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable file: ORT's loading names the problem, as without this
        return None
    if not any(n.op_type == "MultiHeadAttention" for n in model.graph.node) or any(
            t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None
    return model.SerializeToString() if without_dead_queries(model) else None


def backbone_remedies(folder: Path, comps: Mapping[str, Component], bb: Component, provider: str,
                      threads: int | None, profile, providers: list | None, memory) -> tuple:
    """(output correction, precision schedule, its higher-precision backbone session) of the backbone entry `bb`
    (techniques/), each None unless the manifest has it."""
    from ..techniques import correction as correction_record, precision as schedule_record
    from .profiled import backbone_entry

    # a quantized backbone may come with a sampler-side output correction (quantize --correct)
    correction = correction_record.read_record(bb)
    # ... or with a per-step precision schedule: a second, higher-precision backbone for some steps
    schedule = schedule_record.read_record(bb)
    if schedule is None:
        return correction, None, None
    if correction is not None:
        raise UserError(f"{folder}: a backbone with both a correction and a precision schedule is not supported")
    high = backbone_entry(folder, comps[schedule.component], provider, profile)
    if off := disabled(bb):  # the Loop form runs both in one session, at one optimization level
        high = high.with_session_options({"disabled_optimizers": sorted(set(off) | set(disabled(high) or []))})
    session = backbone_session(confined(folder, high.path, "backbone"), high, provider, threads, providers, memory)
    guards.check_io(folder, schedule.component, session, ("sample", "timestep"), ("out_sample",))
    return correction, schedule, session


def load_scheduler(folder: Path) -> tuple[dict, object]:
    """(scheduler config, its schedule) from the folder's scheduler/scheduler_config.json, checked."""
    sched_path = confined(folder, "scheduler/scheduler_config.json", "scheduler config")
    try:
        cfg = check_scheduler_config(json.loads(sched_path.read_bytes().decode("utf-8")), str(sched_path))
        schedule = schedule_from_config(cfg)
        guards.check_schedule(schedule, sched_path)
    except (OSError, ValueError, TypeError, RecursionError) as e:  # JSON and Unicode errors are ValueErrors
        raise UserError(f"{sched_path}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from None
    return cfg, schedule


def lora_backbone(path: Path, entry: Component, component: str, provider: str, profile, make):
    """A folder with LoRA insertion points, on the CPU provider without a hardware profile: its backbone's
    plain and fused sessions (adapters/fused.py: no adapter runs the plain graph, an adapter set its merged
    weights); None otherwise (the points graph runs as it is)."""
    if not entry.lora_targets or provider != "cpu" or profile is not None:
        return None
    from ..adapters.fused import LoraBackbone

    return LoraBackbone(path, component, make)
