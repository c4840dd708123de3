"""Replay tune's reserve at every logged search stop (issue 46 round 7b): the logged timing, checks and load factor
put back into today's formula (which reproduces each logged reserve) and into another, against what the rest of
the run (the stop to OUT written) then took.

    python experiments/tune/reserve_replay.py experiments/tune/r7-*/log.txt experiments/tune/r7-attempts/*/log.txt

Reads the `tune [ NNNs]: ... reserve R s (timing T, checks C; P s a reference picture, load xL)` lines of rounds 6+
(budget.Budget.describe), the default 1200 s budget, 5 timing rounds, and budget.py's MARGIN, RISE, OVERHEAD_S."""

from __future__ import annotations

import re
import sys
from pathlib import Path

BUDGET_S, ROUNDS, FLOOR_ROUNDS = 1200, 5, 3
MARGIN, RISE, OVERHEAD_S = 1.1, 2.0, 20.0  # budget.py's (round 7)
LINE = re.compile(r"tune \[\s*(\d+)s\]: (search done|(\S+): not built \(time budget: (\d+) s to build and try it;)"
                  r".*?reserve (\d+) s \(timing (\d+), checks (\d+); [\d.]+ s a reference picture, load x([\d.]+)\)")
END = re.compile(r"tune \[\s*(\d+)s\]: wrote OUT")


def today(timing: float, checks: float, load: float) -> float:
    """budget.Budget.reserve: the x1 floor on the load factor times max(MARGIN x all, RISE x the cut timing)."""
    rest = checks + OVERHEAD_S * load
    floor_timing = timing * (FLOOR_ROUNDS + 1) / (ROUNDS + 1)
    return max(1.0, load) / load * max(MARGIN * (timing + rest), RISE * (floor_timing + rest))


def suggested(timing: float, checks: float, load: float) -> float:
    """max(MARGIN x max(1, load), RISE x load) x rest: the floor applies to the MARGIN term only."""
    rest = checks + OVERHEAD_S * load
    floor_timing = timing * (FLOOR_ROUNDS + 1) / (ROUNDS + 1)
    return max(max(1.0, load) / load * MARGIN * (timing + rest), RISE * (floor_timing + rest))


def replay(path: Path) -> list[str]:
    text = path.read_text()
    end = END.search(text)
    rows, stop = [], None
    for m in LINE.finditer(text):
        t, what, recipe, need, logged, timing, checks, load = m.groups()
        t, timing, checks, load = int(t), float(timing), float(checks), float(load)
        a, b = today(timing, checks, load), suggested(timing, checks, load)
        if what == "search done":
            stop = (t, int(logged), a, b, load)
        else:
            beyond = BUDGET_S - t - int(need)
            builds = "both" if beyond > a else "the suggestion" if beyond > b else "neither"
            rows.append(f"  {t:4d} s {recipe}: {need} s to build and try, {beyond} s beyond it; reserve today {a:.0f} "
                        f"(logged {logged}), suggested {b:.0f}: builds with {builds}")
    if stop and end:
        t, logged, a, b, load = stop
        rest = int(end.group(1)) - t
        rows.append(f"  stop at {t} s, load x{load:.2f}: reserve today {a:.0f} s (logged {logged}), suggested "
                    f"{b:.0f} s; the rest took {rest} s: today {'inside' if rest <= a else 'OVER'}, suggested "
                    f"{'inside' if rest <= b else 'OVER'}")
    return rows


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(Path(arg).parent.name)
        print("\n".join(replay(Path(arg))) or "  (no logged stop)")
