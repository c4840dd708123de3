"""`tune`'s time budget covers the whole run: the search stops when the budget left is the reserve for the timing
and the checks after it (a fake clock, a stubbed generation whose cost is the clock's), the load factor re-read as
the run goes, and the whole run (search, confirmation, held-out check) overruns the budget by at most one
candidate's generation."""

import numpy as np
import pytest

from onnxdiffusion.tune import finish, measure, search as search_mod
from onnxdiffusion.tune.budget import MARGIN, MIN_ROUNDS, MIN_TOP, OVERHEAD_S, RISE, Budget
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


def _stub_generation(monkeypatch, clock: Clock, load=1.0, costs: list | None = None):
    """measure.generate, its cost on the clock: the reference's per picture, by the steps, times the load (a
    number, or a callable read at each batch: a load that changes as the run goes)."""
    now = load if callable(load) else (lambda: load)

    def fake(pipe, cand, prompts, guidance, batch=16, on_batch=None):
        n, total = len(prompts.prompts), 0.0
        for start in range(0, n, batch):
            k = min(batch, n - start)
            seconds = k * PICTURE_S * cand.steps / DEFAULT.steps * now()
            clock.t += seconds
            total += seconds
            if on_batch is not None:
                on_batch(k, seconds)
        if costs is not None:
            costs.append(total)
        images = np.zeros((n, 4, 4, 3), dtype=np.float32)
        return {"full": images, "tiny": None, "seconds": {"loop": total, "full": 0.0, "tiny": 0.0}}

    monkeypatch.setattr(search_mod, "generate", fake)
    monkeypatch.setattr(measure, "generate", fake)


def _stub_timing(monkeypatch, clock: Clock, load):
    """measure.time_candidates on the clock: one picture a candidate a round (and one untimed), its cost by the
    steps, times the load."""
    from onnxdiffusion.tune import select

    def fake(loaders, cands, prompt, guidance, rounds, progress=None, stop=None):
        one = {c.key: PICTURE_S * c.steps / DEFAULT.steps for c in cands}
        clock.t += sum(one.values()) * load()
        runs = {c.key: [] for c in cands}
        for r in range(rounds):
            round_s = sum(one.values()) * load()
            clock.t += round_s
            for c in cands:
                runs[c.key].append(one[c.key] * load())
            if stop is not None and stop(r + 1, round_s):
                break
        return {k: {"median_s": one[k], "runs": v} for k, v in runs.items()}

    monkeypatch.setattr(select, "time_candidates", fake)


def _search(tmp_path, budget: Budget) -> tuple[Search, Folder]:
    store = Store(tmp_path / "store", tmp_path / "journal.jsonl", "cpu")
    s = Search(store, Bound(30.0, False), TUNE, np.zeros((20, 4, 4, 3), dtype=np.float32), Judged(None), 1.0,
               DEFAULT, budget, log=lambda m: None)
    return s, Folder(FP32, tmp_path, ("cpu",), pipes={"cpu": None})


def test_reserve_is_the_checks_and_the_timing_at_the_reference_speed_and_load():
    clock = Clock()
    b = Budget(600.0, clock=clock)
    b.per_picture, b.references, b.checked, b.timed, b.rounds, b.checked_share = 2.0, 10, 10, 5, 5, 1.0
    full = 2.0 * (10 + 10 + 5 * 6 * 0.8) + OVERHEAD_S
    floor = 2.0 * (10 + 10 + 5 * 4 * 0.8) + OVERHEAD_S  # the timing cut to 3 rounds
    assert b.reserve() == pytest.approx(max(MARGIN * full, RISE * floor))
    b.references, b.checked = 0, 0
    assert b.reserve() == pytest.approx(max(MARGIN * (48 + OVERHEAD_S), RISE * (32 + OVERHEAD_S)))
    b.references, b.checked = 10, 10
    b.observe(10.0, 30.0)  # three times slower than at the reference: the load factor moves halfway there
    assert b.load == pytest.approx(2.0)
    assert b.reserve() == pytest.approx(2.0 * max(MARGIN * full, RISE * floor))
    b.observe(10.0, 0.0001)
    b.observe(10.0, 0.0001)  # a lull: the reserve does not count on it
    assert b.load < 1.0 and b.reserve() == pytest.approx(max(MARGIN * full, RISE * floor))
    clock.t = 600.0 - b.reserve() - 1.0
    assert b.searching() and not b.searching(need=1.01)


def test_the_timing_takes_fewer_candidates_and_rounds_when_the_checks_would_not_fit_at_a_rising_load():
    clock = Clock()
    b = Budget(1000.0, clock=clock)
    b.per_picture, b.checked, b.checked_share = 1.0, 100, 0.5
    assert b.plan_timing(6, 5, 3) == 6 and not b.shrunk  # 1000 s left: 2 x (9 x 4 x 0.8 + 50 + 20)
    clock.t = 1000.0 - 2 * (7 * 4 * 0.8 + 50 + OVERHEAD_S) - 0.1  # room for 3 rounds of seven, not of eight
    assert b.plan_timing(6, 5, 3) == 4 and "7 candidates instead of 9" in b.shrunk[-1]
    clock.t = 999.0  # nothing left: the default, the single levers and MIN_TOP more
    assert b.plan_timing(6, 5, 3) == MIN_TOP
    assert not b.stop_timing(MIN_ROUNDS - 1, 100.0)  # never below the floor
    assert b.stop_timing(MIN_ROUNDS, 100.0) and f"stopped after {MIN_ROUNDS} of 5 rounds" in b.shrunk[-1]
    clock.t = 0.0
    assert not b.stop_timing(MIN_ROUNDS, 1.0)


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


@pytest.mark.parametrize("search_load, checks_load", [(1.0, 1.0), (2.0, 2.0), (1.0, 2.0), (2.0, 4.0)])
def test_the_whole_run_ends_inside_the_budget_when_the_load_doubles_during_the_checks(tmp_path, monkeypatch,
                                                                                       search_load, checks_load):
    """The checks' references, the search, then (at `checks_load`) the walk: its timing (shrunk where the checks
    after it would not fit), the confirmation of the fastest passing point, the held-out check; every picture on
    the fake clock. The reserve held back what they took: the run ends inside the budget but for the one search
    step started just before the reserve."""
    from types import SimpleNamespace

    from onnxdiffusion.tune import run, select

    clock, costs, load = Clock(), [], [search_load]
    _stub_generation(monkeypatch, clock, load=lambda: load[0], costs=costs)
    _stub_timing(monkeypatch, clock, lambda: load[0])
    budget = Budget(900.0, clock=clock)
    confirm, held = PromptSet("confirm", tuple("c" * 40), 100), PromptSet("holdout", tuple("h" * 40), 200)
    budget.per_picture, budget.references, budget.checked = PICTURE_S, 80, 80
    budget.timed, budget.rounds = 9, 5
    search, fp32 = _search(tmp_path, budget)
    search.reference_seconds = {"loop": PICTURE_S, "full": 0.0}
    folders = {FP32: fp32}
    run._references(search.store, folders, DEFAULT, (confirm, held), 1.0, budget, lambda m: None)
    costs.clear()
    # the references re-based the reference's speed: the load factor is now read against their own
    assert budget.references == 0 and budget.per_picture * budget.load == pytest.approx(search_load, rel=0.01)
    search.run_folder(fp32)
    search_costs = list(costs)
    load[0] = checks_load
    seen = []
    confirmed = finish.confirmer(search, folders, DEFAULT, confirm, Judged(None), lambda m: None, seen)
    options = SimpleNamespace(top=6, rounds=5)
    cands, timed, picked = select.walk(search, search.passing({FP32}), DEFAULT, options, {}, "p", confirmed,
                                       lambda m: None)
    chosen = picked["chosen"]
    assert chosen != DEFAULT and seen[0]["confirmed"]
    finish.holdout(search.store, folders, chosen, DEFAULT, held, Judged(None), 1.0, lambda m: None,
                   budget=budget, share=search.share(chosen))
    assert budget.references == 0 and budget.checked == 0
    clock.t += OVERHEAD_S * load[0]  # loading sessions, the judge, writing OUT
    assert clock.t <= budget.budget_s + max(search_costs)
    # the timing was shrunk to keep to it, and said so (at a steady load as far as the search's last step ran into
    # the reserve)
    assert all(n.startswith("timing:") for n in budget.shrunk)
    assert budget.shrunk or checks_load == search_load


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
    monkeypatch.setattr(run, "build_and_search", lambda model, recipes, *a: calls.append(("build", recipes)) or [])
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


@pytest.mark.parametrize("rebase", [True, False])
def test_a_slow_first_reference_is_re_based_on_the_check_references_and_leaves_time_to_search(
        tmp_path, monkeypatch, rebase):
    """r6's MMDiT psnr35 run: the 16-picture reference measured 3.30 s a picture (the sessions' start-up, another
    run's start beside it), the 96 + 96 check references then 2.1 s; the reserve read at the 3.30 s floor left no
    search and ~650 s of the budget unused. Re-based on the check references, the search runs and the whole run
    (timing, confirmation, held-out check, overhead) still ends inside the budget."""
    from types import SimpleNamespace

    from onnxdiffusion.tune import budget as budget_mod, run, select

    if not rebase:  # the code before: the reserve read at the first reference's speed
        monkeypatch.setattr(budget_mod, "REBASE_PICTURES", 10 ** 9)
    clock, costs = Clock(), []
    speed = 2.1  # s a picture, the machine's real speed (PICTURE_S x this load in the stub)
    _stub_generation(monkeypatch, clock, load=speed, costs=costs)
    _stub_timing(monkeypatch, clock, lambda: speed)
    budget = Budget(1200.0, clock=clock)
    clock.t = 59.0  # the 16-picture reference, its sessions' start-up included
    confirm, held = PromptSet("confirm", tuple("c" * 96), 100), PromptSet("holdout", tuple("h" * 96), 200)
    budget.per_picture, budget.references, budget.checked = 3.30, 192, 192
    budget.timed, budget.rounds = 9, 5
    search, fp32 = _search(tmp_path, budget)
    search.reference_seconds = {"loop": 3.30, "full": 0.0}
    folders = {FP32: fp32}
    run._references(search.store, folders, DEFAULT, (confirm, held), 1.0, budget, lambda m: None)
    costs.clear()
    if not rebase:
        assert not budget.searching() and budget.left() > 600  # r6: no search, the budget unused
        return
    assert budget.per_picture == pytest.approx(speed) and budget.load == pytest.approx(1.0, rel=0.01)
    assert budget.searching()
    search.run_folder(fp32)
    assert search.evaluated >= 5 and budget.load == pytest.approx(1.0, rel=0.01)  # the search reads the same speed
    search_costs = list(costs)
    seen = []
    confirmed = finish.confirmer(search, folders, DEFAULT, confirm, Judged(None), lambda m: None, seen)
    cands, timed, picked = select.walk(search, search.passing({FP32}), DEFAULT, SimpleNamespace(top=6, rounds=5),
                                       {}, "p", confirmed, lambda m: None)
    chosen = picked["chosen"]
    assert chosen != DEFAULT and seen[0]["confirmed"]
    finish.holdout(search.store, folders, chosen, DEFAULT, held, Judged(None), 1.0, lambda m: None,
                   budget=budget, share=search.share(chosen))
    clock.t += OVERHEAD_S * speed
    assert clock.t <= budget.budget_s + max(search_costs)


def test_the_rebase_leaves_out_the_first_batch_and_keeps_the_floor():
    b = Budget(600.0, clock=Clock())
    b.per_picture, b.load = 3.0, 0.7
    b.reference_batches = [(16, 16 * 5.0), (16, 16 * 2.0)]  # the first batch's start-up; too few pictures after it
    assert b.rebase() is None and b.per_picture == 3.0
    b.reference_batches.append((16, 16 * 2.0))
    assert "3.00 -> 2.00 s a picture" in b.rebase()
    assert b.per_picture == pytest.approx(2.0) and b.load == pytest.approx(0.7 * 3.0 / 2.0)
    b.load = 0.5  # a lull after the references: the reserve still reads their average
    assert b.pictures_s(10) * max(1.0, b.load) / b.load == pytest.approx(20.0)


def test_the_check_references_batches_go_to_the_rebase_hook_and_the_candidates_do_not(tmp_path, monkeypatch):
    """finish._watch: every batch re-reads the load and is crossed off its own count; only the references' batches
    reach Budget.reference_batch (what rebase reads), through the hook, in order."""
    clock = Clock()
    _stub_generation(monkeypatch, clock, load=2.0)
    budget = Budget(6000.0, clock=clock)
    budget.references, budget.checked = 40, 40
    search, fp32 = _search(tmp_path, budget)
    prompts = PromptSet("h", tuple("x" * 40), 9)
    hooked = []
    monkeypatch.setattr(budget, "reference_batch", lambda n, s: hooked.append((n, s)) or Budget.reference_batch(
        budget, n, s))
    finish.holdout(search.store, {FP32: fp32}, DEFAULT.with_(steps=10), DEFAULT, prompts, Judged(None), 1.0,
                   lambda m: None, budget=budget, share=0.5)
    assert hooked == budget.reference_batches == [(16, 32.0), (16, 32.0), (8, 16.0)]  # the references only
    assert budget.references == 0 and budget.checked == 0  # each generation crossed off its own count
    assert budget.load == pytest.approx(2.0, rel=0.01)  # re-read from both generations' batches
    assert finish._watch(None, 1.0, "references", then=hooked.append) is None  # no budget: no hook


def test_the_reserve_at_r7_sd_psnr35s_stop_covers_the_rest_it_then_took():
    """r7's UNet psnr35 run stopped its search at 814 s at a read load of x0.54 (a lull), its checks priced at the
    fastest passing point's share 0.15 (the quality pass's 0.359 s over the first reference's 2.372 s); the rest
    (timing 78 s, the chosen int8-timestep ddim 20's checks at share 0.63: 177 s) took 256 s against a reserve of
    260. The suggested max(MARGIN x max(1, load), RISE x load) reserve is 173 s there: the search would have built
    int8-static (189 s to build and try, 197 s beyond that reserve) and the run ended ~60-80 s past its budget. The
    x1 floor times RISE is what covered a lull that ended and a share priced 4x too low."""
    b = Budget(1200.0, clock=Clock())
    b.per_picture, b.load, b.references, b.checked, b.checked_share = 1.90, 0.54, 0, 192, 0.359 / 2.372
    b.timed, b.rounds = 9, 5
    assert b.timing_s() == pytest.approx(44, abs=1) and b.checks_s() == pytest.approx(30, abs=1)  # as logged
    assert b.reserve() == pytest.approx(260, abs=1) and b.reserve() >= 256
    rest = b.checks_s() + OVERHEAD_S * b.load
    suggested = max(MARGIN * max(1.0, b.load) / b.load * (b.timing_s() + rest), RISE * (b.floor_timing_s() + rest))
    assert suggested < 256 < b.reserve()
