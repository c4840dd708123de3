"""The end of a `tune` run: time the finalists, choose, check the choice on the held-out prompts, write OUT."""

from __future__ import annotations

import time
from pathlib import Path

from . import measure as M
from .select import choose, latencies, timed_set
from .space import FP32, Candidate


def _loaders(folders: dict) -> dict:
    from ..runtime import Pipeline

    def make(path, profile):
        return lambda: Pipeline.from_folder(path, profile=profile)  # a fresh pipeline: fresh ORT sessions

    return {(r, p): make(f.path, p) for r, f in folders.items() for p in f.profiles}


def holdout(store, folders: dict, cand: Candidate, default: Candidate, prompts: M.PromptSet, judged, guidance,
            log) -> dict:
    """The candidate's quality on prompts the search never saw, and fp32's judge verdict on them."""
    ident = f"{prompts.seed}+{len(prompts.prompts)}/{cand.key}"
    rec = store.get("holdout", ident)
    if rec is not None:
        return rec
    log(f"tune: held-out check on {len(prompts.prompts)} prompts the search never saw")
    ref = store.array(f"reference-holdout-{prompts.seed}-{len(prompts.prompts)}",
                      lambda: M.generate(folders[FP32].pipe(default.profile), default, prompts, guidance)["full"])
    made = M.generate(folders[cand.recipe].pipe(cand.profile), cand, prompts, guidance)
    images = made[cand.decoder]
    return store.put("holdout", ident, {"candidate": cand.to_dict(), **M.score(images, ref, prompts, judged),
                                           "reference": judged(ref, prompts)})


def finish(out: Path, model: Path, manifest, options, search, folders: dict, default: Candidate, holdout_set,
           judged, facts: dict, unavailable: dict, built: list, t0: float, log) -> dict:
    from .output import write_outputs
    from .report import write_report

    passing = search.passing(set(folders))
    cands = timed_set(passing, default, options.top)
    timed = latencies(search.store, cands, _loaders(folders), holdout_set.prompts[0], search.guidance,
                      options.rounds, log)
    picked = choose(timed, passing, default)
    chosen = picked["chosen"]
    held = holdout(search.store, folders, chosen, default, holdout_set, judged, search.guidance, log)
    base = timed[default.key]["median_s"]
    single = picked["single"]
    result = {
        "model": str(model), "machine": facts, "bound": search.bound.describe(),
        "options": {"min_psnr": options.min_psnr, "keep_accuracy": options.keep_accuracy,
                    "time_budget_min": options.time_budget, "tune_count": options.tune_count,
                    "holdout_count": options.holdout_count, "rounds": options.rounds,
                    "recipes": list(options.recipes), "prompts": None if options.prompts is None else str(options.prompts)},
        "reference": {"tune": {"strict": search.bound.reference_strict, "attribute": search.bound.reference_attribute}},
        "default": default.to_dict(), "chosen": chosen.to_dict(), "chosen_folder": str(folders[chosen.recipe].path),
        "tuning_score": picked["scores"].get(chosen.key), "holdout": held,
        "latency_s": {"default": base, "chosen": timed[chosen.key]["median_s"],
                      "best_single_lever": None if single is None else timed[single.key]["median_s"]},
        "speedup": {"vs_default": base / timed[chosen.key]["median_s"],
                    "vs_best_single_lever": None if single is None else
                    timed[single.key]["median_s"] / timed[chosen.key]["median_s"]},
        "best_single_lever": None if single is None else single.to_dict(),
        "runner_up": {k: None if c is None else c.to_dict() for k, c in picked["runner_up"].items()},
        "timed": [{**c.to_dict(), "median_s": timed[c.key]["median_s"], "runs": timed[c.key].get("runs"),
                   "score": picked["scores"].get(c.key)} for c in cands],
        "measured": _measured(search, folders),
        "unavailable_profiles": unavailable, "quantize_builds": built, "notes": search.notes,
        "generations_this_run": search.evaluated,
    }
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_outputs(out, folders[chosen.recipe].path, chosen, result, log)
    write_report(out, result)
    log(f"tune: chose {chosen.label()}: {result['speedup']['vs_default']:.2f}x the default; held-out "
        f"{held['psnr']:.1f} dB" + (f", strict {held['strict']:.3f} (fp32 {held['reference']['strict']:.3f})"
                                   if held.get("strict") is not None else "") + f"; {result['seconds']:.0f} s")
    return result


def replay(out: Path, previous: dict, t0: float, log) -> dict:
    """A search done before with the same bound and settings (the store's record): its choice written again."""
    from .output import write_outputs
    from .report import write_report

    result = {**previous, "generations_this_run": 0, "replayed": True}
    chosen = Candidate.from_dict(result["chosen"])
    log(f"tune: this search was finished before (the store holds it): writing its choice, {chosen.label()}")
    result["seconds"] = round(time.monotonic() - t0, 1)
    write_outputs(out, Path(result["chosen_folder"]), chosen, result, log)
    write_report(out, result)
    return result


def _measured(search, folders) -> list[dict]:
    """Every candidate scored (for the Pareto plot and the table): both decoders of each generation."""
    rows = []
    for (kind, _), rec in search.store.records.items():
        if kind != "quality" or "candidate" not in rec:
            continue
        base = Candidate.from_dict(rec["candidate"])
        if base.recipe not in folders:
            continue
        for dec in ("full", "tiny"):
            s = rec.get(dec)
            if s is not None:
                c = base.with_(decoder=dec)
                rows.append({**c.to_dict(), "key": c.key, "score": s, "passes": search.bound.passes(s),
                             "estimate_s": rec["per_image_s"]["loop"] + rec["per_image_s"][dec]})
    return rows
