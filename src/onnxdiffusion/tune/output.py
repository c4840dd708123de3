"""OUT of a `tune` run: OUT/model, the chosen folder (its files linked, not copied) whose manifest's `recommended`
holds the chosen sampler, steps, cache, decoder and hardware profile, so `generate`, `serve`, `bench` and the page
run it without a flag; tune.json (every figure). report.py writes report.md and pareto.png beside them."""

from __future__ import annotations

import json
from pathlib import Path

from ..folder.artifacts import atomic_dir, atomic_write_bytes, link_files, read_manifest, write_manifest
from ..folder.manifest import as_dict
from .space import Candidate


def tuned_manifest(source: Path, chosen: Candidate, result: dict) -> dict:
    draft = as_dict(read_manifest(source))
    rec = dict(draft.get("recommended") or {})
    rec.update(steps=chosen.steps, sampler=chosen.sampler, decoder=chosen.decoder, profile=chosen.profile)
    rec.pop("cache", None)
    if chosen.cache:
        rec["cache"] = chosen.cache
    draft["recommended"] = rec
    draft["tuned"] = {"bound": result["bound"], "cpu": result["machine"]["cpu"]["model"], "recipe": chosen.recipe,
                      "speedup_vs_default": round(result["speedup"]["vs_default"], 3),
                      "holdout_psnr": result["holdout"]["psnr"], "holdout_strict": result["holdout"].get("strict")}
    return draft


def write_outputs(out: Path, source: Path, chosen: Candidate, result: dict, log) -> None:
    out = Path(out)
    draft = tuned_manifest(source, chosen, result)
    with atomic_dir(out / "model", overwrite=True, inputs=(source,)) as tmp:
        link_files(source, tmp, draft["files"])
        write_manifest(tmp, draft)
    atomic_write_bytes(out / "tune.json", (json.dumps(result, indent=2, default=str) + "\n").encode())
    log(f"tune: wrote {out / 'model'} (generate/serve run it as tuned), {out / 'report.md'}")

