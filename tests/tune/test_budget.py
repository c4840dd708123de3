"""`tune`'s time budget covers the whole run: the search stops when the budget left is the reserve for the timing
and the checks after it (a fake clock, a stubbed generation whose cost is the clock's), the load factor re-read as
the run goes, and the whole run (search, confirmation, held-out check) overruns the budget by at most one
candidate's generation."""

import numpy as np
import pytest

from onnxdiffusion.tune import finish, measure, search as search_mod
from onnxdiffusion.tune.budget import MARGIN, OVERHEAD_S, Budget
from onnxdiffusion.tune.measure import Judged, PromptSet
from onnxdiffusion.tune.search import Bound, Folder, Search
from onnxdiffusion.tune.space import FP32, Candidate
from onnxdiffusion.tune.store import Store

DEFAULT = Candidate(FP32, "ddim", 20, None, "full", "cpu")
TUNE = PromptSet("tune", tuple("p" * 20), 0)  # every point and cache of the space: ~900 s
PICTURE_S = 1.0  # the reference's seconds per picture at load 1


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stub_generation(monkeypatch, clock: Clock, load: float = 1.0, costs: list | None = None):
    """measure.generate, its cost on the clock: the reference's per picture, by the steps, times the load."""
    def fake(pipe, cand, prompts, guidance, batch=16):
        n = len(prompts.prompts)
        seconds = n * PICTURE_S * cand.steps / DEFAULT.steps * load
        clock.t += seconds
        if costs is not None:
            costs.append(seconds)
        images = np.zeros((n, 4, 4, 3), dtype=np.float32)
        return {"full": images, "tiny": None, "seconds": {"loop": seconds, "full": 0.0, "tiny": 0.0}}

    monkeypatch.setattr(search_mod, "generate", fake)
    monkeypatch.setattr(measure, "generate", fake)


def _search(tmp_path, budget: Budget) -> tuple[Search, Folder]:
    store = Store(tmp_path / "store", tmp_path / "journal.jsonl", "cpu")
    s = Search(store, Bound(30.0, False), TUNE, np.zeros((20, 4, 4, 3), dtype=np.float32), Judged(None), 1.0,
               DEFAULT, budget, log=lambda m: None)
    return s, Folder(FP32, tmp_path, ("cpu",), pipes={"cpu": None})


def test_reserve_is_the_checks_and_the_timing_at_the_reference_speed_and_load():
    clock = Clock()
    b = Budget(600.0, clock=clock)
    b.per_picture, b.references, b.checked, b.timed, b.rounds, b.checked_share = 2.0, 10, 10, 2, 4, 1.0
    assert b.reserve() == pytest.approx(MARGIN * (2.0 * (10 + 10 + 2 * 5 * 0.8) + OVERHEAD_S))
    b.observe(10.0, 30.0)  # three times slower than at the reference: the load factor moves halfway there
    assert b.load == pytest.approx(2.0)
    assert b.reserve() == pytest.approx(MARGIN * (2.0 * 2.0 * (10 + 10 + 8) + OVERHEAD_S * 2.0))
    b.observe(10.0, 0.0001)
    b.observe(10.0, 0.0001)  # a lull: the reserve does not count on it
    assert b.load < 1.0 and b.reserve() == pytest.approx(MARGIN * (2.0 * (10 + 10 + 8) + OVERHEAD_S))
    clock.t = 600.0 - b.reserve() - 1.0
    assert b.searching() and not b.searching(need=1.0)


def test_search_stops_when_the_budget_left_is_the_reserve(tmp_path, monkeypatch):
    clock, costs = Clock(), []
    _stub_generation(monkeypatch, clock, costs=costs)
    budget = Budget(600.0, clock=clock)
    budget.per_picture, budget.references, budget.checked = PICTURE_S, 100, 100
    search, fp32 = _search(tmp_path, budget)
    search.run_folder(fp32)
    stop = budget.budget_s - budget.reserve()
    assert search.evaluated > 10 and costs
    assert stop <= clock.t <= stop + max(costs)  # stopped at the reserve, past it by at most one candidate
    assert search.quality(fp32, DEFAULT.with_(steps=5))["skipped"] == "time budget"


def test_a_slower_machine_than_at_the_reference_stops_the_search_earlier(tmp_path, monkeypatch):
    clock, costs = Clock(), []
    _stub_generation(monkeypatch, clock, load=3.0, costs=costs)
    budget = Budget(600.0, clock=clock)
    budget.per_picture, budget.references, budget.checked = PICTURE_S, 100, 100
    search, fp32 = _search(tmp_path, budget)
    search.reference_seconds = {"loop": PICTURE_S, "full": 0.0}
    search.run_folder(fp32)
    assert budget.load >= 2.0  # re-read from the fp32 generations (halfway to the new level each)
    assert clock.t < 600.0 - 220.0 * MARGIN - max(costs)  # the reserve at load 1 would have let it go on


@pytest.mark.parametrize("load", [1.0, 2.0])
def test_the_whole_run_overruns_the_budget_by_at_most_one_candidate(tmp_path, monkeypatch, load):
    """Search, then the confirmation of the fastest passing point and the held-out check (the real holdout(),
    its pictures on the fake clock): the reserve held back what they took."""
    clock, costs = Clock(), []
    _stub_generation(monkeypatch, clock, load=load, costs=costs)
    budget = Budget(900.0, clock=clock)
    confirm, held = PromptSet("confirm", tuple("c" * 40), 100), PromptSet("holdout", tuple("h" * 40), 200)
    budget.per_picture, budget.references, budget.checked = PICTURE_S, 80, 80
    search, fp32 = _search(tmp_path, budget)
    search.reference_seconds = {"loop": PICTURE_S, "full": 0.0}
    search.run_folder(fp32)
    folders = {FP32: fp32}
    seen = []
    confirmed = finish.confirmer(search, folders, DEFAULT, confirm, Judged(None), lambda m: None, seen)
    # the walk confirms the fastest point that passed first (the default's checks cost only their references)
    chosen = min((c for c, _, _ in search.passing({FP32}) if c != DEFAULT), key=lambda c: (search.share(c), c.key))
    assert budget.checked_share == pytest.approx(search.share(chosen))
    assert confirmed(chosen) and seen[0]["confirmed"]
    finish.holdout(search.store, folders, chosen, DEFAULT, held, Judged(None), 1.0, lambda m: None,
                   budget=budget)
    assert budget.references == 0 and budget.checked == 0
    assert clock.t <= budget.budget_s + max(costs)


def test_the_defaults_held_out_pictures_are_its_reference(tmp_path, monkeypatch):
    clock, costs = Clock(), []
    _stub_generation(monkeypatch, clock, costs=costs)
    search, fp32 = _search(tmp_path, Budget(600.0, clock=clock))
    rec = finish.holdout(search.store, {FP32: fp32}, DEFAULT, DEFAULT, PromptSet("h", ("x",), 9), Judged(None),
                         1.0, lambda m: None)
    assert len(costs) == 1 and rec["psnr"] == 100.0  # the reference only


def test_the_first_recipe_is_built_after_the_fp32_folders_own_sampler_then_the_rest(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from onnxdiffusion.folder.paths import default_model_folder
    from onnxdiffusion.tune import run
    from onnxdiffusion.tune.run import TuneOptions

    monkeypatch.setenv("ONNXDIFFUSION_CACHE", str(tmp_path / "cache"))
    calls = []

    def run_folder(folder, fp32_points=None, fp32_cached=None, quick=False):
        calls.append(("search", folder.recipe, quick))
        return [], []

    budget = Budget(600.0, clock=Clock())
    search = SimpleNamespace(run_folder=run_folder, searching=lambda: True, budget=budget,
                             generation_s=lambda: 10.0)
    monkeypatch.setattr(run, "_quantized", lambda model, recipes, *a: calls.append(("build", recipes)) or [])
    opts = TuneOptions(min_psnr=35.0, recipes=("int8-timestep", "int8-static"))
    run._search(default_model_folder(), opts, search, {FP32: Folder(FP32, tmp_path, ("cpu",))}, {}, print)
    assert calls == [("search", FP32, True), ("build", ("int8-timestep",)), ("search", FP32, False),
                     ("build", ("int8-static",))]


def test_the_defaults_tiny_decoder_is_checked_from_the_reference_generation(tmp_path, monkeypatch):
    clock, costs = Clock(), []
    _stub_generation(monkeypatch, clock, costs=costs)
    real = measure.generate

    def with_tiny(*a, **k):
        out = real(*a, **k)
        return {**out, "tiny": out["full"] + 1.0}

    monkeypatch.setattr(measure, "generate", with_tiny)
    search, fp32 = _search(tmp_path, Budget(600.0, clock=clock))
    prompts = PromptSet("h", ("x", "y"), 9)
    finish.holdout(search.store, {FP32: fp32}, DEFAULT, DEFAULT, prompts, Judged(None), 1.0, lambda m: None)
    rec = finish.holdout(search.store, {FP32: fp32}, DEFAULT.with_(decoder="tiny"), DEFAULT, prompts, Judged(None),
                         1.0, lambda m: None)
    assert len(costs) == 1 and rec["psnr"] < 100.0  # one generation: the reference's, both decoders
