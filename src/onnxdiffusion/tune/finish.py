"""The end of a `tune` run: time the finalists, choose, check the choice on the held-out prompts, write OUT."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from . import measure as M
from .budget import Budget
from .select import walk
from .space import FP32, Candidate


def _loaders(folders: dict) -> dict:
    from ..runtime import Pipeline

    def make(path, profile):
        return lambda: Pipeline.from_folder(path, profile=profile)  # a fresh pipeline: fresh ORT sessions

    return {(r, p): make(f.path, p) for r, f in folders.items() for p in f.profiles}


def reference_name(kind: str, prompts: M.PromptSet) -> str:
    """The store's name of fp32's pictures on a check's prompts (made once, whichever candidate is checked)."""
    return f"reference-{kind}-{prompts.seed}-{len(prompts.prompts)}"


def picture_name(kind: str, prompts: M.PromptSet, generation: str, decoder: str) -> str:
    """The store's name of one generation's pictures through one decoder on a check's prompts."""
    import hashlib

    tag = hashlib.sha256(generation.encode()).hexdigest()[:16]
    return f"{kind}-{prompts.seed}-{len(prompts.prompts)}-{tag}-{decoder}"


OnBatch = Callable[[int, float], None]  # (pictures, seconds) of one batch: measure.generate's on_batch


def _watch(budget: Budget | None, share: float, attr: str, then: OnBatch | None = None) -> OnBatch | None:
    """on_batch for measure.generate: the load factor re-read from each batch of pictures (`share` of the
    reference's cost each), the batch crossed off what the budget holds back for `attr`, then `then` called with
    the batch (the references' hook: budget.Budget.reference_batch)."""
    if budget is None:
        return None

    def seen(images: int, seconds: float) -> None:
        budget.observe(images * budget.per_picture * share, seconds)
        setattr(budget, attr, max(0, getattr(budget, attr) - images))
        if then is not None:
            then(images, seconds)

    return seen


def reference(store, folders: dict, default: Candidate, prompts: M.PromptSet, guidance, kind: str, budget=None):
    """fp32's pictures on a check's prompts (made once, whichever candidate is checked; run.py makes them before
    the search, so the time after it holds only the chosen candidate's own pictures)."""
    def make():
        made = M.generate(folders[FP32].pipe(default.profile), default, prompts, guidance,
                          on_batch=_watch(budget, 1.0, "references",
                                          then=None if budget is None else budget.reference_batch))
        if made["tiny"] is not None:  # the default's tiny-decoder pictures: that candidate then costs no generation
            store.array(picture_name(kind, prompts, default.generation, "tiny"), lambda: made["tiny"])
        return made["full"]

    return store.array(reference_name(kind, prompts), make)


def holdout(store, folders: dict, cand: Candidate, default: Candidate, prompts: M.PromptSet, judged, guidance,
            log, kind: str = "holdout", budget=None, share: float = 1.0) -> dict:
    """The candidate's quality on another prompt set (the confirmation's, or the held-out one the search and the
    confirmation never saw), and fp32's judge verdict on it. `budget` (budget.Budget): crossed off as the pictures
    are made, its load factor re-read from each batch (`share`: the candidate's cost vs the reference's)."""
    ident = f"{prompts.seed}+{len(prompts.prompts)}/{cand.key}"
    rec = store.get(kind, ident)
    if rec is not None:
        return rec
    n = len(prompts.prompts)
    log(f"tune: {kind} check of {cand.label()} on {n} other prompts")
    ref = reference(store, folders, default, prompts, guidance, kind, budget)
    before = 0 if budget is None else budget.checked
    if cand.generation == default.generation and cand.decoder == "full":
        images = ref  # the default's pictures are the reference itself: not generated again
    else:
        images = _pictures(store, folders, cand, prompts, guidance, kind, _watch(budget, share, "checked"))
    if budget is not None:  # what the batches did not cross off (the default's, pictures found in the store)
        budget.checked = max(0, budget.checked - (n - (before - budget.checked)))
    return store.put(kind, ident, {"candidate": cand.to_dict(), **M.score(images, ref, prompts, judged),
                                   "reference": judged(ref, prompts)})


def _pictures(store, folders: dict, cand: Candidate, prompts: M.PromptSet, guidance, kind: str, on_batch=None):
    """The candidate's pictures on a check's prompts. One generation gives both decoders' pictures, each kept in
    the store: a candidate that differs from a checked one only by its decoder costs a lookup, not a generation."""
    def name(decoder: str) -> str:
        return picture_name(kind, prompts, cand.generation, decoder)

    made: dict = {}

    def make():
        made.update(M.generate(folders[cand.recipe].pipe(cand.profile), cand, prompts, guidance, on_batch=on_batch))
        for other in ("full", "tiny"):
            if other != cand.decoder and made[other] is not None:
                store.array(name(other), lambda o=other: made[o])
        return made[cand.decoder]

    return store.array(name(cand.decoder), make)


def confirmer(search, folders: dict, default: Candidate, prompts: M.PromptSet, judged, log, seen: list):
    """c -> whether the candidate keeps the bound on the confirmation prompts too (its own fp32 verdicts, the PSNR
    floor, and where the judge reads them the paired test of accuracy.py): a point that passed on the few tuning
    prompts by luck is turned down before it is chosen. `seen` gets one row per confirmation (for the report).
    A candidate not confirmed before is not confirmed once one was when its confirmation and the held-out check
    left would overrun the budget (the default needs no confirmation)."""
    from .accuracy import discordant, expected_discordant, expected_ok, paired_ok
    from .search import Bound

    def confirmed(c: Candidate) -> bool:
        ident = f"{prompts.seed}+{len(prompts.prompts)}/{c.key}"
        # the budget bounds the walk, not its first step: the fastest is always confirmed (else an overrun in
        # the timing would hand back the default however much faster the candidates were)
        budget = search.budget
        further = search.store.get("confirm", ident) is None and any("psnr" in r for r in seen)
        share = search.share(c.with_(decoder="full"))  # a generation's cost (both decoders come of it)
        if further and budget.left() < budget.after_s(0.0, len(prompts.prompts) + budget.checked, share):
            seen.append({"candidate": c.to_dict(), "confirmed": False, "why": "time budget"})
            log(f"tune: {c.label()}: not confirmed (time budget: {budget.describe()})")
            return False
        if further:
            budget.checked += len(prompts.prompts)  # the reserve held one confirmation; holdout() crosses it off
        budget.checked_share = share
        rec = holdout(search.store, folders, c, default, prompts, judged, search.guidance, log, kind="confirm",
                      budget=budget, share=share)
        ref = rec.get("reference") or {}
        bound = Bound(search.bound.min_psnr, search.bound.keep_accuracy, ref.get("strict"), ref.get("attribute"),
                      search.bound.psnr_floor)
        ok = bound.passes(rec)
        row = {"candidate": c.to_dict(), "psnr": rec["psnr"], "strict": rec.get("strict"),
               "reference_strict": ref.get("strict")}
        if search.bound.keep_accuracy and rec.get("strict_each") is not None and ref.get("strict_each") is not None:
            n = len(prompts.prompts)
            b, cc = discordant(rec["strict_each"], ref["strict_each"])
            row.update(lost=b, gained=cc, paired_ok=paired_ok(b, cc, n))
            if rec.get("margin_each") is not None and ref.get("margin_each") is not None:
                eb, ec = expected_discordant(rec["margin_each"], ref["margin_each"])
                row.update(expected_lost=round(eb, 2), expected_gained=round(ec, 2),
                           expected_ok=expected_ok(eb, n))
                row["paired_ok"] = row["paired_ok"] and row["expected_ok"]
            ok = ok and row["paired_ok"]
        row["confirmed"] = ok
        seen.append(row)
        log(f"tune: {c.label()}: {'confirmed' if ok else 'turned down'} on the confirmation prompts "
            f"({rec['psnr']:.1f} dB" + (f", strict {rec['strict']:.3f} vs fp32 {ref['strict']:.3f}" if ref else "")
            + (f", {row['lost']} prompts lost / {row['gained']} gained vs fp32" if "lost" in row else "")
            + (f", expected from the judge's margins {row['expected_lost']:.2f} / {row['expected_gained']:.2f}"
               if "expected_lost" in row else "") + ")")
        return ok

    return confirmed


def doubter(search, n: int):
    """score -> whether the tuning prompts' margins expect the confirmation on `n` prompts to turn the candidate
    down (select.choose confirms those last); None where the bound does not read the judge."""
    from .accuracy import doubtful

    ref = search.reference_margins
    if not search.bound.keep_accuracy or not ref:
        return None
    return lambda s: bool(s) and doubtful(s.get("margin_each"), ref, n)


def finish(out: Path, model: Path, manifest, options, search, folders: dict, default: Candidate, sets: tuple,
           judged, facts: dict, unavailable: dict, built: list, t0: float, log) -> dict:
    """`sets`: (the confirmation prompts, the held-out prompts)."""
    from .output import write_outputs
    from .report import write_report

    confirm_set, holdout_set = sets
    if search.bound.keep_accuracy:
        from .accuracy import psnr_floor

        search.bound.psnr_floor, floor_info = psnr_floor(search.scored(set(folders)), search.reference_each)
        log(f"tune: PSNR floor from the tuning data: {search.bound.psnr_floor} dB ({floor_info})")
    passing = search.passing(set(folders))
    seen: list = []
    cands, timed, picked = walk(search, passing, default, options, _loaders(folders), holdout_set.prompts[0],
                                confirmer(search, folders, default, confirm_set, judged, log, seen), log,
                                doubter(search, len(confirm_set.prompts)))
    chosen = picked["chosen"]
    held = holdout(search.store, folders, chosen, default, holdout_set, judged, search.guidance, log,
                   budget=search.budget, share=search.share(chosen.with_(decoder="full")))
    base = timed[default.key]["median_s"]
    single = picked["single"]
    result = {
        "model": str(model), "machine": facts, "bound": search.bound.describe(),
        "options": {"min_psnr": options.min_psnr, "keep_accuracy": options.keep_accuracy,
                    "time_budget_min": options.time_budget, "tune_count": options.tune_count,
                    "holdout_count": options.holdout_count, "confirm_count": options.confirm_count,
                    "rounds": options.rounds,
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
        "turned_down": [c.to_dict() for c in picked["rejected"]], "confirmations": seen,
        "psnr_floor": search.bound.psnr_floor,
        "timed": [{**c.to_dict(), "median_s": timed[c.key]["median_s"], "runs": timed[c.key].get("runs"),
                   "score": picked["scores"].get(c.key)} for c in cands],
        "measured": _measured(search, folders),
        "unavailable_profiles": unavailable, "quantize_builds": built, "notes": search.notes,
        "shrunk": list(search.budget.shrunk),
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
    return [{**c.to_dict(), "key": c.key, "score": s, "passes": search.bound.passes(s),
             "estimate_s": rec["per_image_s"]["loop"] + rec["per_image_s"][c.decoder]}
            for c, s, rec in search.scored(folders)]
