"""The quantized folders `tune` builds and the profiles each one is searched on.

A profile's `recipe` block says how the folder it runs is made (profiles/__init__.py); besides the recipe's name,
the fields it declares are the folder's form (`openvino-int8`: `stored: qdq`, the portable QDQ graph OpenVINO runs
whole). So, for each `--recipes` recipe in order:

- the recipe with quantize's defaults (QUANTIZE_ARGS) is built and searched on the profiles that run a backbone of
  its precision here and whose declared fields its manifest's recipe holds (a CPU-fused int8 folder is not searched
  on `openvino-int8`: OpenVINO cannot run ORT's own operators, 132 in the shapes-sd UNet besides its 14 fused
  attentions, and would run the graph split around each, 3-4x ORT's own int8 step in experiments/amx);
- right after it, each form that a profile available here declares for that recipe and that its defaults do not
  make (int8-static `-O stored=qdq` where onnxruntime-openvino is installed) is built as a folder of its own (its
  own content hash) and searched on the profiles declaring that form only: ORT's CPU provider runs the same weights
  from the CPU-fused folder, searched already. It is built only where the recipe's default folder did not miss the
  bound at the folder's own sampler and steps on every profile it ran on: the form changes the kernels that run the
  same quantized weights, not the quantization, and OpenVINO's kernels only lost picture (experiments/amx: -0.41 /
  -0.13 dB vs int8-static on the embedded models; experiments/tune round 7c, onnxruntime-openvino 1.24.1 on the
  EPYC, shapes-sd ddim 20, 4 prompts: the qdq folder 49.69 dB on cpu-int8 as the CPU-fused one's 49.67, 45.34 dB on
  openvino-int8).

Where no profile declares another form (no onnxruntime-openvino here), the builds are the recipes as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

QUANTIZE_ARGS = ("--no-quality", "--latency-runs", "3")  # a build's arguments (with --threads 1): its cache key


@dataclass(frozen=True)
class Build:
    recipe: str  # quantize's --recipe
    options: tuple[tuple[str, str], ...] = ()  # -O KEY=VALUE: the form profiles declare (none: the recipe's defaults)
    for_profiles: tuple[str, ...] = ()  # the profiles that declare that form

    @property
    def name(self) -> str:
        """The folder's name in the search (Candidate.recipe): the recipe, then each option
        (`int8-static+stored=qdq`)."""
        return self.recipe + "".join(f"+{k}={v}" for k, v in self.options)

    @property
    def args(self) -> tuple[str, ...]:
        """quantize's arguments besides --recipe and --threads."""
        return (*QUANTIZE_ARGS, *(a for k, v in self.options for a in ("-O", f"{k}={v}")))


def _text(value) -> str:
    """A declared field as quantize's -O takes it (a list: comma-separated)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def declared(profile) -> dict[str, str]:
    """The form a profile declares for the folders it runs: its recipe block's fields besides the name."""
    return {str(k): _text(v) for k, v in (profile.recipe or {}).items() if k != "name"}


def _form(fields: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def runs(profile, recipe: Mapping) -> bool:
    """Whether a folder quantized with `recipe` (its manifest's record) has the form `profile` declares."""
    return all(k in recipe and _text(recipe[k]) == v for k, v in declared(profile).items())


def _usable():
    """The shipped profiles this machine can run, each with why not for the others (GPU profiles: not tune's)."""
    from ..profiles import GPU_PROVIDERS, load_profile, shipped

    for name in shipped():
        p = load_profile(name)
        yield p, "a GPU profile" if p.provider in GPU_PROVIDERS else p.unavailable_reason()


def profiles_for(precision: str, recipe: Mapping | None = None
                 ) -> tuple[tuple[str, ...], dict[str, str], dict[str, str]]:
    """(the shipped profiles that run a backbone of `precision` here, {profile: why not} for the others, {profile:
    why not} for those available here that declare another form than `recipe`'s, a quantized folder's record)."""
    ok, why, form = [], {}, {}
    for p, reason in _usable():
        if p.precision not in (precision, "any"):
            continue
        if reason is not None:
            why[p.name] = reason
        elif recipe is not None and not runs(p, recipe):
            form[p.name] = (f"{p.name} runs folders quantized with {_form(declared(p))}, this one has "
                            f"{_form({k: _text(recipe.get(k, '-')) for k in declared(p)})}")
        else:
            ok.append(p.name)
    return tuple(ok), why, form


def plan(recipe: str) -> list[Build]:
    """The builds for one `--recipes` recipe: its defaults first, then each other form a profile available here
    declares for it (the profiles declaring one form share its build)."""
    from ..errors import UserError
    from ..quantize.configs import recipe_class

    builds: dict[tuple, list[str]] = {}
    for p, reason in _usable():
        form = declared(p)
        if reason is not None or not form or (p.recipe or {}).get("name") != recipe:
            continue
        try:
            cls = recipe_class(recipe)
            made, default = cls.with_options(form).to_dict(), cls().to_dict()
        except UserError:
            continue  # a form quantize cannot make: the profile's own `recipe` hint says as much where it is used
        options = tuple(sorted((k, v) for k, v in form.items() if made.get(k) != default.get(k)))
        if options:
            builds.setdefault(options, []).append(p.name)
    return [Build(recipe), *(Build(recipe, o, tuple(names)) for o, names in builds.items())]


def missed_everywhere(search, name: str) -> bool:
    """Whether folder `name` was searched here and missed the bound at the folder's own sampler and steps on every
    profile it ran on (the store's records; False where it has none)."""
    d = search.default
    recs = [rec for (kind, _), rec in search.store.records.items()
            if kind == "quality" and "candidate" in rec and rec["candidate"]["recipe"] == name
            and (rec["candidate"]["sampler"], rec["candidate"]["steps"], rec["candidate"]["cache"]) ==
            (d.sampler, d.steps, None)]
    return bool(recs) and not any(search.passed(rec) for rec in recs)


def precision(folder) -> str:
    """A folder's backbone precision as a profile names it."""
    return _facts(folder)[0]


def _facts(folder) -> tuple[str, Mapping]:
    """(a folder's backbone precision as a profile names it, the recipe quantize recorded: {} for a float folder)."""
    from ..families import get_family
    from ..folder.artifacts import read_manifest
    from ..profiles import precision_family

    m = read_manifest(folder)
    return precision_family(m.components[get_family(m.family).backbone].precision), m.quantization_recipe


def build_and_search(model, recipes: tuple[str, ...], search, folders: dict, points, cached, unavailable: dict,
                     log) -> list[dict]:
    """Each recipe's builds (plan) made (or found in the cache) while the budget allows a build and a generation on
    it, then searched; a record per build."""
    records = []
    for recipe in recipes:
        for build in plan(recipe):
            rec, path = _build(model, build, search, unavailable, log)
            records.append(rec)
            if rec.get("profiles"):
                from .search import Folder

                folders[build.name] = Folder(build.name, path, tuple(rec["profiles"]))
                search.run_folder(folders[build.name], fp32_points=points, fp32_cached=cached)
    return records


def _build(model, build: Build, search, unavailable: dict, log) -> tuple[dict, object]:
    """(one build's record: skipped (the bound, the budget), an error, or built / cached with the profiles that
    search it; the folder, None where none was made)."""
    import time

    from ..adapters.folder import cache_root
    from ..bench.quantized import build_siblings, sibling_folder
    from ..errors import UserError
    from ..folder.artifacts import MANIFEST

    base = build.recipe  # the recipe's default folder, searched before this build
    # a build of another form says so in its record (the report's hand-spelled command and its "why" read it)
    form = {"quantize_recipe": build.recipe, "for_profiles": list(build.for_profiles)} if build.options else {}
    if build.options and missed_everywhere(search, base):
        log(f"tune: {build.name}: not built ({base} missed the bound at the folder's own sampler and steps; the "
            "stored form changes the kernels, not the quantized weights)")
        return {"recipe": build.name, **form, "skipped": f"{base} missed the bound"}, None
    cache = cache_root() / "quantized"
    folder = sibling_folder(cache, model, build.recipe, (*build.args, "--threads", "1"))
    have = (folder / MANIFEST).is_file()
    need = (0 if have else search.budget.build_s()) + search.generation_s()
    if not search.budget.searching(need):
        log(f"tune: {build.name}: not built (time budget: {need:.0f} s to build and try it; "
            f"{search.budget.describe()})")
        return {"recipe": build.name, **form, "skipped": "time budget"}, None
    log(f"tune: {build.name}: {'cached' if have else 'building'} ({folder})")
    t = time.monotonic()
    try:
        [path], [rec] = build_siblings(model, (build.recipe,), cache, build.args, threads=1, progress=False)
    except UserError as e:
        log(f"tune: {build.name}: {e}")
        return {"recipe": build.name, **form, "error": str(e)}, None
    if not rec.get("cached"):
        search.budget.observe_build(time.monotonic() - t)
    profiles, why, other = profiles_for(*_facts(path))
    unavailable.update(why)
    if build.for_profiles:  # another form: searched on the profiles that declare it only
        profiles = tuple(p for p in profiles if p in build.for_profiles)
    for name, text in other.items():
        search.note(f"{build.name} not searched on {name}: {text}")
    rec.update(recipe=build.name, **form, profiles=list(profiles))
    return rec, path
