"""`compile-loop --controlnet NAME`: the folder's ControlNets built into the sampling graph (techniques/controlnet_graph.py)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def check_names(manifest: dict, names, form: str, whole: bool, family) -> list[dict]:
    """The records of the ControlNets to compile (one line on an unknown name or a combination not built)."""
    names = list(names or ())
    if not names:
        return []
    if whole:  # (what ControlNet does not combine with: techniques/registry.py, checked by compile_loop)
        raise UserError("--controlnet is built into the plain Loop / unrolled graph (not --whole)")
    if len(set(names)) != len(names):
        raise UserError(f"--controlnet names must be distinct, got {names}")
    nets = manifest.controlnets or {}
    from ..techniques.controlnet import residuals_of

    records = []
    for name in names:
        if name not in nets:
            have = ", ".join(sorted(nets)) or "none (add one: onnxdiffusion add-controlnet)"
            raise UserError(f"no ControlNet {name!r} in the folder; it has {have}")
        records.append(nets[name])
    first = records[0]
    for name, rec in zip(names, records):
        if residuals_of(family, rec) != residuals_of(family, first):
            raise UserError(f"ControlNets {names[0]!r} and {name!r} give residuals of different shapes")
    return records


def cut_backbone(unet, family, records: list[dict], entry: dict, large: bool):
    """The backbone cut to take the residuals, before ONNX Runtime's passes see it (as it is without nets)."""
    from ..runtime.control_graph import add_residual_inputs

    if not records:
        return unet
    # with a precision schedule or run-time LoRA: refused before, by the registry's table (compile.py)
    if large:
        raise UserError("--controlnet in the sampling graph does not support a backbone over 2 GB yet (use --loop host)")
    return add_residual_inputs(unet, family, records[0])


def load_nets(folder: Path, records: list[dict], level=None) -> list:
    """Each ControlNet's graph (fp16 storage expanded; ORT's optimized CPU graph at `level` when given)."""
    import onnx

    from ..folder.manifest import confined
    from ..onnxio import fp16_storage
    from ..runtime.session import check_external_data

    models = []
    for rec in records:
        path = confined(folder, rec["path"], "ControlNet")
        check_external_data(path)
        model = fp16_storage.expand(onnx.load(str(path)), str(path))
        if level is not None:
            from ..onnxio.session import ort_optimized

            model = ort_optimized(model, level=level)
        models.append(model)
    return models


def graph_control(folder: Path, records: list[dict], level, family) -> list:
    """The ControlNets' Loop twin for build_sampling_graph's techniques ([] without nets)."""
    from ..runtime.control_graph import residual_names
    from ..techniques.controlnet_graph import ControlLoop

    if not records:
        return []
    return [ControlLoop(load_nets(folder, records, level), residual_names(family, records[0]),
                        [bool(r.get("cond_only")) for r in records])]
