"""`tune(model, out, options)`: the library function behind `onnxdiffusion tune` (search.py searches, select.py
times and chooses, output.py writes OUT, report.py the report)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError
from ..fields import option
from .accuracy import default_count
from .builds import build_and_search, precision, profiles_for
from .space import DEFAULT_RECIPES, FP32, Candidate

# scene seeds: the tuning, confirmation and held-out prompts never overlap
TUNE_START, HOLDOUT_START, CONFIRM_START = 50_000, 60_000, 70_000


def _recipes(text: str) -> tuple[str, ...]:
    """--recipes A,B (none: fp32 only) -> (A, B)."""
    return tuple(r.strip() for r in text.split(",") if r.strip() and r.strip() != "none")


@dataclass(frozen=True)
class TuneOptions:
    """What `tune` takes; each field with help is also an option of the `tune` verb (cli/options.py)."""
    min_psnr: float | None = option(
        None, "bound: mean image PSNR (dB) vs the model's own fp32 pictures on the tuning prompts (on the scene "
              "prompts the judge reads, fp32's accuracy is kept too)")
    keep_accuracy: bool = option(False, "bound: the judge's strict accuracy within 1 point of fp32's (scene prompts)",
                                 flags=("--keep-accuracy",))
    time_budget: float = option(20.0, "minutes for the whole run")
    prompts: Path | None = option(None, "tuning prompts, one a line (default: the scene world's held-out prompts, "
                                        "which the judge reads)")
    tune_count: int = option(16, "tuning prompts")
    # None: 96 where the bound reads the judge (its accuracy on a few dozen prompts is too coarse), else 32
    holdout_count: int | None = option(None, "held-out prompts of the final check (default 96 where the judge reads "
                                             "them, else 32)")
    confirm_count: int | None = option(None, "prompts the fastest candidates are confirmed on before one is chosen "
                                             "(default as --holdout-count)")
    recipes: tuple[str, ...] = option(DEFAULT_RECIPES, "quantize recipes tried, in order, comma-separated (none: fp32 "
                                                       "only)", cli_type=str, cli_default=",".join(DEFAULT_RECIPES),
                                      convert=_recipes)
    rounds: int = option(5, "interleaved timing rounds")
    top: int = 6  # timed besides the default and the best single levers
    overwrite: bool = option(False, "write into a non-empty OUT that holds no tune journal")


def check_options(o: TuneOptions) -> None:
    from ..bench.variants import KNOWN_RECIPES

    if o.min_psnr is None and not o.keep_accuracy:
        raise UserError("give a quality bound: --min-psnr DB and/or --keep-accuracy")
    if o.min_psnr is not None and (isinstance(o.min_psnr, bool) or not 0 < o.min_psnr <= 100):
        raise UserError(f"--min-psnr must be in (0, 100] dB, got {o.min_psnr!r}")
    if not 0.5 <= o.time_budget <= 24 * 60:
        raise UserError(f"--time-budget must be 0.5..1440 minutes, got {o.time_budget!r}")
    if o.keep_accuracy and o.prompts is not None:
        raise UserError("--keep-accuracy reads the judge's verdicts on the scene prompts; leave out --prompts")
    for name, v in (("tune-count", o.tune_count), ("holdout-count", o.holdout_count),
                    ("confirm-count", o.confirm_count), ("rounds", o.rounds)):
        if v is None and name in ("holdout-count", "confirm-count"):
            continue  # the default for the bound
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1024:
            raise UserError(f"--{name} must be an integer in [1, 1024], got {v!r}")
    bad = [r for r in o.recipes if r not in KNOWN_RECIPES]
    if bad:
        raise UserError(f"unknown recipe {bad[0]!r}; choose from {', '.join(KNOWN_RECIPES)}")


def _prepare_out(out: Path, model: Path, overwrite: bool) -> None:
    out = Path(out)
    m, o = Path(model).resolve(), out.resolve()
    if o == m or m in o.parents or o in m.parents:
        raise UserError(f"OUT {out} overlaps the model folder {model}")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "journal.jsonl").is_file() and not overwrite:
        raise UserError(f"OUT {out} is not empty and holds no tune journal (pass --overwrite to write into it)")
    if not out.parent.is_dir():
        raise UserError(f"OUT's parent does not exist: {out.parent}")
    out.mkdir(exist_ok=True)


def tune(model: Path | str | None, out: Path | str, options: TuneOptions, log=None) -> dict:
    """Search the levers for the fastest configuration within the bound on this machine; write OUT (the tuned
    folder OUT/model, report.md, pareto.png, tune.json, journal.jsonl). Returns tune.json's content."""
    from ..adapters.folder import cache_root
    from ..bench.machine import machine_facts
    from ..folder.artifacts import read_manifest
    from ..folder.paths import default_model_folder
    from ..runtime import Pipeline
    from ..runtime.generation import GenerateOptions
    from . import measure as M
    from .budget import Budget
    from .machine import session_facts
    from .search import Bound, Folder, Search
    from .store import Store, search_key

    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    check_options(options)
    model = Path(model) if model is not None else default_model_folder()
    out = Path(out)
    manifest = read_manifest(model)
    if manifest.quantization_recipe:
        raise UserError(f"{model} is already quantized ({manifest.quantization_recipe.get('name')}); tune starts "
                        "from the fp32 folder (its own reference)")
    _prepare_out(out, model, options.overwrite)
    t0 = time.monotonic()
    budget = Budget(options.time_budget * 60, t0=t0)

    def log(message: str) -> None:  # every phase's line with the seconds elapsed
        say(budget.stamp(message))

    facts = {**machine_facts(), "session": session_facts()}
    fp32_profiles, unavailable, _ = profiles_for(precision(model))
    if not fp32_profiles:
        raise UserError(f"no shipped profile runs {model}'s backbone here ({'; '.join(unavailable.values())})")
    fp32 = Folder(FP32, model, fp32_profiles)
    pipe = fp32.pipe(fp32_profiles[0])
    d = pipe.resolve(GenerateOptions())
    default = Candidate(FP32, d.sampler, d.steps, None, "full", fp32_profiles[0])
    if options.prompts is not None:
        tune_set = M.file_set(options.prompts, options.tune_count)
    else:
        tune_set = M.scene_set("tune", options.tune_count, TUNE_START)
    key, cpu_key = search_key(manifest, [tune_set.describe()], d.guidance, facts["cpu"]["model"])
    store = Store(cache_root() / "tune" / key, out / "journal.jsonl", cpu_key)
    judged = M.Judged(M.load_judge() if tune_set.scenes is not None else None)
    if options.keep_accuracy and judged.judge is None:
        raise UserError("--keep-accuracy needs the judge (models/judge), which this checkout lacks")
    log(f"tune: {model} on {facts['cpu']['model']}; default {default.label()}; store {store.root}")

    def reference():
        made = M.generate(pipe, default, tune_set, d.guidance)
        made_ref.append(made)
        return made["full"]

    made_ref: list = []
    ref = store.array("reference-tune", reference)
    ref_verdict = judged(ref, tune_set)
    # the judge where the model has one: on prompts it reads, a PSNR bound keeps fp32's accuracy too
    bound = Bound(options.min_psnr, options.keep_accuracy or ref_verdict is not None, *(
        (ref_verdict["strict"], ref_verdict["attribute"]) if ref_verdict else (None, None)))
    reads = ref_verdict is not None
    options = replace(options, holdout_count=default_count(options.holdout_count, reads),
                      confirm_count=default_count(options.confirm_count, reads))
    holdout_set = M.scene_set("holdout", options.holdout_count, HOLDOUT_START)
    confirm_set = M.scene_set("confirm", options.confirm_count, CONFIRM_START)
    search = Search(store, bound, tune_set, ref, judged, d.guidance, default, budget, log)
    search.reference_each = (ref_verdict or {}).get("strict_each")
    search.reference_margins = (ref_verdict or {}).get("margin_each")
    log(f"tune: bound {bound.describe()}")
    if made_ref:  # the reference run is the default's own generation: scored once, not generated again
        search.record(default, made_ref[0])
    _reserve(budget, search, store, default, (confirm_set, holdout_set), options)
    log(f"tune: budget: {budget.describe()}")
    run_id = _run_id(bound, options, default)
    done = store.get("run", run_id)
    if done is not None and Path(done["result"]["chosen_folder"]).is_dir():
        from .finish import replay

        return replay(out, done["result"], t0, log)
    folders = {FP32: fp32}
    _references(store, folders, default, (confirm_set, holdout_set), d.guidance, budget, log)
    built = _search(model, options, search, folders, unavailable, log)
    log(f"tune: search done: {budget.describe()}")
    from .finish import finish

    result = finish(out, model, manifest, options, search, folders, default, (confirm_set, holdout_set), judged,
                    facts, unavailable, built, t0, log)
    store.put("run", run_id, {"result": result})
    return result


def _run_id(bound, options: TuneOptions, default: Candidate) -> str:
    """A finished search with the same bound and settings is not searched again: a re-run gives its choice (a run
    cut short by its budget would otherwise go on where it stopped and might choose another point)."""
    import hashlib
    import json

    what = {"bound": bound.describe(), "default": default.key, "budget": options.time_budget,
            "holdout": options.holdout_count, "confirm": options.confirm_count, "recipes": list(options.recipes),
            "rounds": options.rounds,
            "top": options.top}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _reserve(budget, search, store, default: Candidate, sets: tuple, options: TuneOptions) -> None:
    """What the run after the search will take, in reference pictures: its speed from the reference's own
    generation (measured now, or kept in the store by the run that made it)."""
    from .finish import reference_name

    rec = store.get("quality", default.generation)
    if rec is not None and "per_image_s" in rec:
        search.reference_seconds = rec["per_image_s"]
        budget.per_picture = rec["per_image_s"]["loop"] + rec["per_image_s"]["full"]
    budget.references = sum(len(p.prompts) for kind, p in zip(("confirm", "holdout"), sets)
                            if not store.has_array(reference_name(kind, p)))
    budget.checked = sum(len(p.prompts) for p in sets)
    budget.timed, budget.rounds = options.top + 3, options.rounds  # the default, two single levers, the top


def _references(store, folders: dict, default: Candidate, sets: tuple, guidance: float, budget, log) -> None:
    """The checks' fp32 references, before the search: they do not depend on the choice, and made now their time
    is what it is (the search gets what is left) instead of a guess the reserve holds against a rising load."""
    from .finish import reference, reference_name

    todo = [(kind, p) for kind, p in zip(("confirm", "holdout"), sets) if not store.has_array(reference_name(kind, p))]
    if not todo:
        return
    log(f"tune: fp32 references of the checks: {' + '.join(str(len(p.prompts)) for _, p in todo)} prompts")
    for kind, p in todo:
        reference(store, folders, default, p, guidance, kind, budget)
    rebased = budget.rebase()
    if rebased:
        log(f"tune: {rebased}")
    log(f"tune: references made: {budget.describe()}")


def _search(model: Path, options: TuneOptions, search, folders: dict, unavailable: dict, log) -> list[dict]:
    """Cheap first, but one quantize build early enough: the fp32 folder's own sampler down its steps, the first
    recipe's folder, then with time left the rest of the fp32 search (the other samplers, the caches), the quantized
    folder following it to its new points, and the other recipes."""
    fp32 = folders[FP32]
    first, rest = options.recipes[:1], options.recipes[1:]
    # the quick pass is a few generations, each cheaper than the last (what passes there also sets the checks'
    # cost, so the build is weighed against the reserve it really leaves)
    points, cached = search.run_folder(fp32, quick=bool(first))
    built = build_and_search(model, first, search, folders, points, cached, unavailable, log)
    if search.searching():
        points, cached = search.run_folder(fp32)
        for recipe, folder in folders.items():
            if recipe != FP32 and search.searching():
                search.run_folder(folder, fp32_points=points, fp32_cached=cached)
    return built + build_and_search(model, rest, search, folders, points, cached, unavailable, log)
