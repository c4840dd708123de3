"""What `export` asks of adapters/: fused LoRAs (before torch loads a weight: files checked; after each
module loads: merged) and insertion points (after the components are written). Small on purpose: the
export loop calls three functions and knows nothing of LoRA."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .points import SCOPES


def before_export(options, configs: dict) -> list[dict]:
    if options.lora_points is not None and options.lora_points not in SCOPES:
        raise UserError(f"--lora-points must be one of {', '.join(SCOPES)}, got {options.lora_points!r}")
    if not options.loras:
        return []
    from .fuse import check_loras

    present = {n for n in configs if "/" not in n and n not in ("model_index", "scheduler")}
    return check_loras(options.loras, present)


def fuse(module, component: str, records: list[dict]) -> None:
    if records:
        from .fuse import fuse_into

        fuse_into(module, component, records)


def after_export(tmp: Path, draft: dict, options, records: list[dict]) -> None:
    """`draft`: the manifest export is writing (a dict, its hash list not made yet)."""
    if records:
        from .fuse import manifest_records

        draft["lora_fused"] = manifest_records(records)
    if options.lora_points is None:
        return
    from ..folder.manifest import Component, confined
    from .folder import lora_components, rewrite_component

    comps = {n: Component.from_dict(n, e) for n, e in draft["components"].items()}
    for name in lora_components(draft["family"], comps):
        path = confined(tmp, comps[name].path, name)
        draft["components"][name]["lora"] = rewrite_component(tmp, comps[name], path, options.lora_points)
        draft["components"][name]["bytes"] = path.stat().st_size
