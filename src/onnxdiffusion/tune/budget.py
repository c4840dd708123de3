"""The time budget of a `tune` run covers all of it, the checks after the search included. Before the search
stops, the time the rest of the run will take is held back (the reserve): the latency timing, the confirmation
and the held-out check (their fp32 references and the candidate's own pictures), in units of the reference's
measured seconds per picture, scaled by how much slower the machine runs now than when that was measured (the load
factor, re-estimated from each fp32 generation of the search and each reference of the checks). The search goes
on while the budget left exceeds the reserve; one candidate started just before that point is the most a run can
overrun by (its cost is the search's step, not a guess the reserve could be wrong about).

The checks' fp32 references are made before the search (they do not depend on the choice), so what follows the
search is only the timing and the chosen candidate's own pictures. The reserve holds them at the load read now with
MARGIN, and at RISE times that load with the timing cut to MIN_ROUNDS rounds: a load that doubles during the checks
still ends inside the budget, since the timing's rounds are then cut (stop_timing: after each round, whether the
next and the checks after it still fit at RISE times the load re-read from every batch of the checks' pictures),
and where the load rose before the timing starts, fewer candidates are timed (plan_timing)."""

from __future__ import annotations

import time

from .space import STEP_FRACTIONS

# a quantize build costs about this many reference pictures (issue 46 r3 at load 25, 4-6.7 s a picture: int8-timestep
# 243-296 s, int8-static 384-511 s; 30-40 s at ~0.8 s a picture idle)
BUILD_PICTURES = 60.0
# a timed candidate's one picture vs the reference's (the timed ones are the faster ones, besides the default)
TIMED_SHARE = 0.8
# a checked candidate's picture vs the reference's until the search found one that passed (search.py then holds the
# fastest that passed): the first point of fewer steps the search tries (space.STEP_FRACTIONS), the fastest a
# choice other than the default costs before anything is known (1.0 would leave a loaded machine no search at all)
CHECKED_SHARE = STEP_FRACTIONS[1]
OVERHEAD_S = 20.0  # loading sessions and the judge, the floor, writing OUT (seconds on an idle machine)
# the reserve's margin over its estimate: on the shared 2-core EPYC the load swung by a third within minutes (17 to
# 29 in r4's first UNet run, whose checks then overran the reserve read at a load factor of 0.78); 1.4 left no search
# at load 25 (the 96 + 96 prompts' checks alone are 70% of 20 minutes there), so the floor on the load factor does
# most of the work and this covers a moderate rise
MARGIN = 1.1
LOAD_WEIGHT = 0.5  # of the latest measurement in the re-estimated load factor
# the rise of the load during the checks a run must survive: r5's MMDiT psnr35 run read x0.97 when its search stopped
# and its checks then ran at load 20-23 against ~16 (21:26 against 20 min); the shared 2-core EPYC doubles its load
# within minutes when a neighbour starts a build
RISE = 2.0
MIN_ROUNDS = 3  # timing rounds a cut timing keeps: a median of fewer is one noisy run
MIN_TOP = 1  # of the pre-ranking's fastest, a shrunk timing keeps this many besides the default and the single levers
# the checks' references re-base the reference's seconds a picture when they hold at least this many pictures after
# their first batch (which is left out: where the sessions are new it carries their start-up)
REBASE_PICTURES = 32


class Budget:
    """`budget_s` from `t0` on `clock`; `per_picture`: the reference's seconds per picture when it was measured."""

    def __init__(self, budget_s: float, clock=time.monotonic, t0: float | None = None):
        self.budget_s, self.clock = budget_s, clock
        self.t0 = clock() if t0 is None else t0
        self.per_picture = 1.0  # until the reference's generation says otherwise
        self.load = 1.0
        self.build_seen: float | None = None  # seconds the last quantize build took
        self.checked_share = CHECKED_SHARE
        # what is still to come after the search (run.py fills these in, finish.py crosses them off)
        self.references = 0  # fp32 reference pictures of the checks not made yet
        self.checked = 0  # the candidate's pictures of the checks not made yet
        self.timed = 0  # candidates to time
        self.rounds = 5
        self.shrunk: list[str] = []  # what the run shrank to keep to the budget, and why (for the report)
        self.reference_batches: list[tuple[int, float]] = []  # (pictures, seconds) of the checks' references

    # -- the clock ----------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    # -- what things cost now ------------------------------------------------------------------------------------
    def pictures_s(self, n: float) -> float:
        """Seconds `n` reference pictures take now."""
        return n * self.per_picture * self.load

    def build_s(self) -> float:
        return self.build_seen if self.build_seen is not None else self.pictures_s(BUILD_PICTURES)

    def timing_s(self, candidates: int | None = None, rounds: int | None = None) -> float:
        n = self.timed if candidates is None else candidates
        r = self.rounds if rounds is None else rounds
        return self.pictures_s(n * (r + 1) * TIMED_SHARE)

    def floor_timing_s(self) -> float:
        """The timing cut to MIN_ROUNDS rounds (stop_timing's floor)."""
        return self.timing_s(rounds=min(self.rounds, MIN_ROUNDS))

    def checks_s(self, references: int | None = None, checked: int | None = None, share: float | None = None) -> float:
        r = self.references if references is None else references
        c = self.checked if checked is None else checked
        return self.pictures_s(r + c * (self.checked_share if share is None else share))

    def reserve(self) -> float:
        """Seconds the rest of the run after the search may take: its estimate at the load factor, never below the
        reference's own (a lull in the load is not counted on), times MARGIN; and at least what it takes at RISE
        times that load with the timing at its floor. The floor and RISE compound on purpose: r7's UNet psnr35 run
        stopped at a read load of x0.54 with its checks priced at a share 4x below the chosen point's, and the rest
        took 256 s against this reserve's 260 (max(MARGIN x max(1, load), RISE x load) held 173 s: experiments/tune,
        round 7b)."""
        scale = max(1.0, self.load) / self.load
        rest = self.checks_s() + OVERHEAD_S * self.load
        return scale * max(MARGIN * (self.timing_s() + rest), RISE * (self.floor_timing_s() + rest))

    def after_s(self, timing_s: float, checked: int | None = None, share: float | None = None) -> float:
        """What the run still needs after a timing of `timing_s` seconds (now's load), with the checks left (or
        `checked` of the candidate's pictures at `share`), at RISE times the load (never below the reference's)."""
        scale = max(1.0, self.load) / self.load
        return scale * RISE * (timing_s + self.checks_s(checked=checked, share=share) + OVERHEAD_S * self.load)

    def plan_timing(self, top: int, rounds: int, levers: int) -> int:
        """How many of the pre-ranking's fastest the timing about to start takes besides the `levers` (the default
        and the single levers): `top` when the budget left holds MIN_ROUNDS rounds of them and the checks after it
        at RISE times the load, else fewer (to MIN_TOP), the shrinking said in `shrunk`. Its rounds are cut as it
        goes (stop_timing)."""
        self.rounds = rounds
        t = top
        while t > min(top, MIN_TOP) and self.left() < self.after_s(self.timing_s(levers + t, MIN_ROUNDS)):
            t -= 1
        if t != top:
            self.shrunk.append(f"timing: {levers + t} candidates instead of {levers + top} ({self.left():.0f} s "
                               f"left at {self.elapsed():.0f} s, load x{self.load:.2f}: {MIN_ROUNDS} rounds of them "
                               f"and the checks after need {self.after_s(self.timing_s(levers + t, MIN_ROUNDS)):.0f} "
                               f"s at {RISE:g}x that load)")
        return t

    def stop_timing(self, done: int, round_s: float) -> bool:
        """After `done` timing rounds of `round_s` seconds the last: whether to stop (the next round and the
        checks after it at RISE times the load no longer fit; never below MIN_ROUNDS)."""
        if done < MIN_ROUNDS or done >= self.rounds:
            return False
        if self.left() >= self.after_s(round_s):  # a measured round: already at now's load
            return False
        self.shrunk.append(f"timing: stopped after {done} of {self.rounds} rounds ({self.left():.0f} s left at "
                           f"{self.elapsed():.0f} s, {round_s:.0f} s a round, load x{self.load:.2f})")
        return True

    def searching(self, need: float = 0.0) -> bool:
        """Whether a search step that takes `need` seconds (besides the one it is about to start) still leaves
        the reserve."""
        return self.left() - need > self.reserve()

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds

    # -- learning as the run goes ----------------------------------------------------------------------------
    def observe(self, expected_s: float, actual_s: float) -> None:
        """A measurement that was expected to take `expected_s` at the reference's speed took `actual_s`."""
        if expected_s > 0 and actual_s > 0:
            self.load = (1 - LOAD_WEIGHT) * self.load + LOAD_WEIGHT * actual_s / expected_s

    def rebase(self) -> str | None:
        """The reference's seconds a picture re-read from the checks' references (`reference_batches`, the first
        batch left out), the load factor carried over to the new base: the 16-picture reference is short and carries
        the sessions' start-up (r6's MMDiT psnr35 run: 3.30 s a picture beside another run's start, then 2.1 s over
        the 192 check references, and the reserve read at the 3.30 s floor left ~650 s of the budget unused). The
        floor on the load factor then holds at this longer average: a lull below it is still not counted on.
        Returns the change for the log (None: too few pictures, nothing changed)."""
        rest = self.reference_batches[1:]
        n = sum(i for i, _ in rest)
        if n < REBASE_PICTURES:
            return None
        seconds = sum(s for _, s in rest) / n
        before, load = self.per_picture, self.load
        self.load = load * before / seconds  # the latest batches against the new base
        self.per_picture = seconds
        return (f"the reference's speed re-based on {n} check references: {before:.2f} -> {seconds:.2f} s a "
                f"picture (load x{load:.2f} -> x{self.load:.2f})")

    def reference_batch(self, images: int, seconds: float) -> None:
        """One batch of the checks' fp32 references was made: kept for `rebase` (finish.reference's hook)."""
        self.reference_batches.append((images, seconds))

    def observe_build(self, seconds: float) -> None:
        # kept apart from the load factor: a build's cost does not scale with the load as a generation's does
        self.build_seen = seconds

    def stamp(self, message: str) -> str:
        """A phase's log line with the seconds elapsed: `tune: ...` -> `tune [  NNNs]: ...`."""
        head = "tune: "
        return f"tune [{self.elapsed():5.0f}s]: {message[len(head):]}" if message.startswith(head) else message

    def describe(self) -> str:
        return (f"{self.elapsed():.0f} s of {self.budget_s:.0f} s spent; reserve {self.reserve():.0f} s (timing "
                f"{self.timing_s():.0f}, checks {self.checks_s():.0f}; {self.per_picture:.2f} s a reference picture, "
                f"load x{self.load:.2f})")
