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


def after_export(tmp: Path, manifest: dict, options, records: list[dict]) -> None:
    if records:
        from .fuse import manifest_records

        manifest["lora_fused"] = manifest_records(records)
    if options.lora_points is None:
        return
    from ..manifest import confined
    from .folder import lora_components, rewrite_component

    for name in lora_components(manifest):
        entry = manifest["components"].get(name)
        if entry is None:
            continue
        path = confined(tmp, entry["path"], name)
        entry["lora"] = rewrite_component(tmp, entry, path, options.lora_points)
        entry["bytes"] = path.stat().st_size
