"""The quantized folders `tune` builds and the profiles each is searched on (tune/builds.py): where a profile that
runs portable QDQ int8 is available (`openvino-int8`, its recipe `stored: qdq`), int8-static is also built
`-O stored=qdq` and searched on that profile only, and the CPU-fused folders are not searched on it; where it is not
(no onnxruntime-openvino), the builds are the recipes as given, searched as before. Availability is monkeypatched:
the builds and the searches are fakes that record what they were asked."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from onnxdiffusion.folder.paths import default_model_folder
from onnxdiffusion.profiles import Profile, load_profile
from onnxdiffusion.tune import builds
from onnxdiffusion.tune.builds import Build, plan, profiles_for, runs
from onnxdiffusion.tune.report import hand_spelled
from onnxdiffusion.tune.space import DEFAULT_RECIPES, FP32, Candidate

SD = default_model_folder()
DEFAULT = Candidate(FP32, "ddim", 20, None, "full", "cpu-fp32")
QDQ = Build("int8-static", (("stored", "qdq"),), ("openvino-int8",))


def _openvino(monkeypatch, available: bool) -> None:
    """The openvino profiles available here (as with onnxruntime-openvino installed) or not; the CPU ones are."""
    def reason(self):
        if self.provider == "cpu" or (available and self.provider == "openvino"):
            return None
        return f"no {self.provider} here (test)"

    monkeypatch.setattr(Profile, "unavailable_reason", reason)


def test_plan_offers_the_qdq_build_with_openvino_int8_only_where_that_profile_is_available(monkeypatch):
    _openvino(monkeypatch, False)
    assert plan("int8-static") == [Build("int8-static")] and plan("int8-timestep") == [Build("int8-timestep")]
    _openvino(monkeypatch, True)
    assert plan("int8-static") == [Build("int8-static"), QDQ]
    assert plan("int8-timestep") == [Build("int8-timestep")]  # no profile declares a form of it
    assert QDQ.name == "int8-static+stored=qdq" and Build("int8-static").name == "int8-static"
    # the default build's arguments are round 7's (its content hash, its cached folder, unchanged)
    assert Build("int8-static").args == ("--no-quality", "--latency-runs", "3")
    assert QDQ.args == ("--no-quality", "--latency-runs", "3", "-O", "stored=qdq")


def test_a_profile_runs_only_folders_of_the_form_it_declares(monkeypatch):
    ov, cpu = load_profile("openvino-int8"), load_profile("cpu-int8")
    fused, qdq = {"name": "int8-static", "stored": "cpu-fused"}, {"name": "int8-static", "stored": "qdq"}
    assert runs(cpu, fused) and runs(cpu, qdq) and runs(ov, qdq) and not runs(ov, fused)
    assert not runs(ov, {"name": "int4-weights"})  # a recipe without the field: not that form
    _openvino(monkeypatch, True)
    ok, why, other = profiles_for("int8", fused)
    assert ok == ("cpu-int8",) and "openvino-int8" not in why
    assert other == {"openvino-int8": "openvino-int8 runs folders quantized with stored=qdq, this one has "
                                      "stored=cpu-fused"}
    assert profiles_for("int8", qdq)[0] == ("cpu-int8", "openvino-int8")
    _openvino(monkeypatch, False)
    ok, why, other = profiles_for("int8", fused)
    assert ok == ("cpu-int8",) and "openvino-int8" in why and other == {}


class FakeSearch:
    """What builds.build_and_search reads of search.Search; a folder searched records its first point (passing
    unless its name is in `missing`)."""

    def __init__(self, missing=()):
        self.default, self.missing = DEFAULT, set(missing)
        self.store = SimpleNamespace(records={})
        self.budget = SimpleNamespace(build_s=lambda: 0.0, searching=lambda need=0.0: True, describe=lambda: "",
                                      observe_build=lambda s: None)
        self.notes, self.searched = [], []

    def generation_s(self, share=1.0):
        return 0.0

    def passed(self, rec):
        return rec["passes"]

    def note(self, text):
        self.notes.append(text)

    def run_folder(self, folder, fp32_points=None, fp32_cached=None):
        self.searched.append((folder.recipe, folder.profiles))
        for p in folder.profiles:
            c = Candidate(folder.recipe, "ddim", 20, None, "full", p)
            self.store.records[("quality", c.generation)] = {"candidate": c.to_dict(),
                                                             "passes": folder.recipe not in self.missing}


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """quantize stubbed: each build a folder name, its manifest's recipe stored as its -O options say."""
    import onnxdiffusion.bench.quantized as q

    monkeypatch.setenv("ONNXDIFFUSION_CACHE", str(tmp_path / "cache"))
    made, recipes = [], {}

    def build_siblings(model, names, cache, args=(), threads=None, progress=True):
        [recipe] = names
        stored = "qdq" if "stored=qdq" in args else "cpu-fused"
        path = Path(cache) / f"{recipe}-{stored}"
        made.append((recipe, tuple(args)))
        recipes[path] = {"name": recipe, "stored": stored}
        return [path], [{"recipe": recipe, "folder": path.name, "quantize_args": [*args, "--threads", "1"],
                         "cached": True}]

    monkeypatch.setattr(q, "build_siblings", build_siblings)
    monkeypatch.setattr(builds, "_facts", lambda path: ("int8", recipes[Path(path)]))
    return made


def _run(search, recipes=DEFAULT_RECIPES):
    folders, unavailable = {}, {}
    records = builds.build_and_search(SD, recipes, search, folders, [], [], unavailable, log=lambda m: None)
    return records, folders, unavailable


def test_without_openvino_the_builds_and_searches_are_the_recipes_as_given(monkeypatch, fake_builds):
    _openvino(monkeypatch, False)
    search = FakeSearch()
    records, folders, unavailable = _run(search)
    assert [r["recipe"] for r in records] == ["int8-timestep", "int8-static"]
    assert fake_builds == [("int8-timestep", Build("x").args), ("int8-static", Build("x").args)]
    assert search.searched == [("int8-timestep", ("cpu-int8",)), ("int8-static", ("cpu-int8",))]
    assert search.notes == [] and "openvino-int8" in unavailable and set(folders) == {"int8-timestep", "int8-static"}
    assert all("quantize_recipe" not in r and r["profiles"] == ["cpu-int8"] for r in records)


def test_with_openvino_the_qdq_folder_is_built_after_int8_static_and_searched_on_openvino_int8_only(
        monkeypatch, fake_builds):
    _openvino(monkeypatch, True)
    search = FakeSearch()
    records, folders, unavailable = _run(search)
    assert [r["recipe"] for r in records] == ["int8-timestep", "int8-static", "int8-static+stored=qdq"]
    assert fake_builds[-1] == ("int8-static", QDQ.args)
    # the CPU-fused folders on cpu-int8 only (each says why not on openvino-int8), the qdq one on openvino-int8 only
    assert search.searched == [("int8-timestep", ("cpu-int8",)), ("int8-static", ("cpu-int8",)),
                               ("int8-static+stored=qdq", ("openvino-int8",))]
    assert search.notes == [f"{r} not searched on openvino-int8: openvino-int8 runs folders quantized with stored=qdq, "
                            "this one has stored=cpu-fused" for r in ("int8-timestep", "int8-static")]
    qdq = records[-1]
    assert qdq["quantize_recipe"] == "int8-static" and qdq["for_profiles"] == ["openvino-int8"]
    assert "openvino-int8" not in unavailable and folders["int8-static+stored=qdq"].profiles == ("openvino-int8",)
    # the report's hand-spelled command quantizes the same form
    chosen = Candidate("int8-static+stored=qdq", "ddim", 12, None, "full", "openvino-int8")
    cmds = hand_spelled({"chosen": chosen.to_dict(), "quantize_builds": records})
    assert cmds[0] == ("onnxdiffusion quantize MODEL int8-static+stored=qdq-folder --recipe int8-static --no-quality "
                       "--latency-runs 3 -O stored=qdq --threads 1")
    assert cmds[1].endswith("--profile openvino-int8")


def test_the_qdq_folder_is_not_built_where_int8_static_missed_the_bound_at_the_folders_own_point(
        monkeypatch, fake_builds):
    _openvino(monkeypatch, True)
    search = FakeSearch(missing={"int8-static"})
    records, folders, _ = _run(search, ("int8-static",))
    assert records[-1] == {"recipe": "int8-static+stored=qdq", "quantize_recipe": "int8-static",
                           "for_profiles": ["openvino-int8"], "skipped": "int8-static missed the bound"}
    assert [r for r, _ in fake_builds] == ["int8-static"] and "int8-static+stored=qdq" not in folders
