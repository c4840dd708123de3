"""From what passed to the choice: which candidates are timed (the default, the best single lever of each kind by
the quality pass's seconds, and the fastest few by the same pre-ranking), their latency (measured here, or this CPU's
stored figures when every one of them has some: a re-run then picks the same point), the choice (the fastest
timed candidate within the bound that holds at confirmation; when none does, the walk goes on down the ranking)
and, per lever, the runner-up."""

from __future__ import annotations

from .measure import time_candidates
from .search import estimate
from .space import LEVERS, Candidate, changed_levers


def timed_set(passing: list, default: Candidate, top: int) -> list[Candidate]:
    ranked = sorted(passing, key=lambda p: (estimate(p[0], p[2]), p[0].key))  # a tie: by key (None < str fails)
    chosen = [default]
    for lever in LEVERS:
        single = [c for c, _, _ in ranked if changed_levers(c, default) == (lever,)]
        chosen += single[:1]
    chosen += [c for c, _, _ in ranked[:top]]
    return list(dict.fromkeys(chosen))


def stored(store, cands: list[Candidate]) -> bool:
    return all(store.get("timing", c.key) for c in cands)


def latencies(store, cands: list[Candidate], loaders: dict, prompt: str, guidance: float, rounds: int, log,
              stop=None) -> dict:
    """`stop(done, round_s)`: time_candidates' (the time budget's call after each round)."""
    if stored(store, cands):
        log(f"tune: latencies of the {len(cands)} timed candidates: this CPU's stored figures")
        return {c.key: store.get("timing", c.key) for c in cands}
    log(f"tune: timing {len(cands)} candidates: fresh sessions, {rounds} interleaved rounds of one image each")
    measured = time_candidates(loaders, cands, prompt, guidance, rounds,
                               progress=lambda r, n: log(f"tune: timing round {r}/{n}"), stop=stop)
    return {c.key: store.put("timing", c.key, {"candidate": c.to_dict(), **measured[c.key]}) for c in cands}


def choose(timed: dict, passing: list, default: Candidate, confirmed=lambda c: True, doubtful=None) -> dict:
    """The fastest timed candidate within the bound that `confirmed(c)` holds for (tried fastest first, so only as
    many are confirmed as it takes; ties: fewer levers moved; the default always holds), the best single lever and
    the runner-up per lever (the fastest timed candidate with another value of that lever), both among those within
    the bound and not turned down by `confirmed`. `doubtful(score)`: candidates the tuning data already expects to
    be turned down are confirmed after the others (a confirmation costs the budget what another may then lack)."""
    ok = {c.key: (c, s) for c, s, _ in passing}
    rows = sorted(((timed[k]["median_s"], len(changed_levers(c, default)), c) for k, (c, s) in ok.items() if k in timed),
                  key=lambda r: (r[0], r[1], r[2].key))
    doubt = {r[2].key: bool(doubtful and r[2] != default and doubtful(ok[r[2].key][1])) for r in rows}
    rejected = []
    best = default
    for r in sorted(rows, key=lambda r: doubt[r[2].key]):  # stable: fastest first within each
        if r[2] == default or confirmed(r[2]):
            best = r[2]
            break
        rejected.append(r[2])
    rows = [r for r in rows if r[2] not in rejected]
    single = [r[2] for r in rows if r[1] == 1]
    runner_up = {}
    for lever in LEVERS:
        other = [r[2] for r in rows if r[2].lever(lever) != best.lever(lever)]
        runner_up[lever] = other[0] if other else None
    return {"chosen": best, "single": single[0] if single else None, "runner_up": runner_up,
            "scores": {k: s for k, (c, s) in ok.items()}, "rejected": rejected,
            "doubtful": [r[2] for r in rows if doubt[r[2].key]]}


def walk(search, passing: list, default: Candidate, options, loaders: dict, prompt: str, confirmed, log,
         doubtful=None):
    """Time and choose (the fastest confirmed); when every timed candidate faster than the default is turned down at
    confirmation, the next ones by the pre-ranking are timed (with the default and the best single levers again,
    so each choice reads one interleaved session) and walked in turn, while candidates estimated faster than the
    default are left and the time budget allows another timing, a confirmation and the held-out check. Returns
    (the last timed set, its latencies, choose's result with every candidate turned down on the way)."""
    rejected: list[Candidate] = []
    dropped: set[Candidate] = set()  # timed, not turned down, but no faster than the default
    est = {c.key: estimate(c, rec) for c, _, rec in passing}
    while True:
        pool = [p for p in passing if p[0] not in dropped and p[0] not in rejected]
        b = search.budget
        cands, rounds = timed_set(pool, default, options.top), options.rounds
        if not stored(search.store, cands):  # fewer where the checks after it would not fit at a rising load
            noted = len(b.shrunk)
            cands = timed_set(pool, default, b.plan_timing(options.top, rounds, len(timed_set(pool, default, 0))))
            for note in b.shrunk[noted:]:
                log(f"tune: shrunk: {note}")
        noted = len(b.shrunk)
        timed = latencies(search.store, cands, loaders, prompt, search.guidance, rounds, log, stop=b.stop_timing)
        for note in b.shrunk[noted:]:
            log(f"tune: shrunk: {note}")
        b.timed = 0  # timed: no longer held back
        picked = choose(timed, pool, default, confirmed, doubtful)
        if picked["doubtful"]:
            log(f"tune: confirmed after the others (the tuning prompts' margins expect them turned down): "
                f"{', '.join(c.label() for c in picked['doubtful'])}")
        rejected += picked["rejected"]
        picked["rejected"] = list(rejected)
        if picked["chosen"] != default:
            return cands, timed, picked
        dropped |= {c for c in cands if c != default and c not in rejected}
        base = est.get(default.key, float("inf"))
        left = [c for c, _, _ in passing if c not in dropped and c not in rejected and c != default
                and est[c.key] < base]
        if not left or b.left() < b.after_s(b.timing_s(min(options.top, len(left)) + 3, options.rounds)):
            return cands, timed, picked
        log(f"tune: every timed candidate was turned down; timing the next {min(options.top, len(left))} of "
            f"{len(left)} left that the quality pass ranked faster than the default")
