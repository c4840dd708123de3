"""`tune`'s staged search. Cheap levers first, on the model's own fp32 folder: sampler x steps (fewest steps
last: a sampler stops at its first step count that misses the bound), then each step-cache spec on the points that
passed; every generation is scored through both decoders (the tiny one decodes the same latents). Then the
quantized folders, each built once (`quantize` in a subprocess, cached by content hash) only while the time budget
allows (the fp32 folder's first pass walks only its own sampler down its steps, so a quantized point is reached
inside the budget; the checks after the search are held back, budget.py), and tried first at the
folder's own sampler and steps: quantization only adds error, so a recipe that
misses there is dropped, and otherwise only the points that passed in fp32 are tried on it. A staged search
suffices here: the levers' effects on quality are close to monotone (fewer steps, a cache, a quantized backbone
each only add error), which is what lets each stage prune the next."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .budget import Budget
from .measure import Judged, PromptSet, generate, score
from .space import CACHES, FP32, Candidate, samplers, step_counts



@dataclass
class Bound:
    min_psnr: float | None
    keep_accuracy: bool
    reference_strict: float | None = None  # fp32's strict accuracy on the tuning prompts
    reference_attribute: float | None = None
    psnr_floor: float | None = None  # dB, where the bound reads the judge: calibrated on the tuning data (accuracy.py)

    def passes(self, s: dict | None) -> bool:
        if s is None:
            return False
        if self.min_psnr is not None and s["psnr"] < self.min_psnr:
            return False
        if self.keep_accuracy:
            if self.psnr_floor is not None and s["psnr"] < self.psnr_floor:
                return False
            # within 1 point of fp32's strict accuracy, and no attribute lost on net: on a small tuning set one
            # prompt is several points, so the finer attribute count guards the held-out check
            if s.get("strict") is None or s["strict"] < self.reference_strict - 0.01:
                return False
            if s["attribute"] < self.reference_attribute - 0.005:
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.min_psnr is not None:
            parts.append(f"mean PSNR >= {self.min_psnr:g} dB vs fp32")
        if self.keep_accuracy:
            parts.append(f"strict accuracy >= fp32's ({self.reference_strict:.3f}) - 1 point")
            if self.psnr_floor is not None:
                parts.append(f"mean PSNR >= {self.psnr_floor:g} dB (the floor below which the judge's verdicts "
                             "flipped on the tuning images)")
        return " and ".join(parts)


@dataclass
class Folder:
    recipe: str
    path: Path
    profiles: tuple[str, ...]
    pipes: dict = field(default_factory=dict)  # profile -> the quality pass's Pipeline (made on first use)

    def pipe(self, profile: str):
        if profile not in self.pipes:
            from ..runtime import Pipeline

            self.pipes[profile] = Pipeline.from_folder(self.path, profile=profile)
        return self.pipes[profile]


class Search:
    def __init__(self, store, bound: Bound, prompts: PromptSet, reference, judged: Judged, guidance: float,
                 default: Candidate, budget: Budget, log=None):
        self.store, self.bound, self.prompts, self.reference = store, bound, prompts, reference
        self.judged, self.guidance, self.default, self.budget = judged, guidance, default, budget
        self.budget_s = budget.budget_s
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.evaluated = 0
        self.notes: list[str] = []
        self.reference_each: list | None = None  # fp32's per-prompt strict verdicts on the tuning prompts
        self.reference_margins: list | None = None  # ... and the judge's margins of them (finish.doubter)
        self.reference_seconds: dict | None = None  # the reference's per_image_s: what the load factor reads

    # -- time ---------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.budget.elapsed()

    def searching(self) -> bool:
        return self.budget.searching()

    def generation_s(self, share: float = 1.0) -> float:
        """Seconds one generation on the tuning prompts takes now, `share` of the reference's cost."""
        return self.budget.pictures_s(share * len(self.prompts.prompts))

    def _observe(self, cand: Candidate, seconds: dict) -> None:
        """The load factor from an fp32 generation without a cache (its cost is the reference's, by the steps)."""
        r = self.reference_seconds
        if r is None or cand.recipe != FP32 or cand.cache is not None:
            return
        n = len(self.prompts.prompts)
        # its share of the reference's cost, at the budget's seconds a picture (re-based on the check references)
        share = (r["loop"] * cand.steps / self.default.steps + r["full"]) / (r["loop"] + r["full"])
        expected = n * share * self.budget.per_picture
        self.budget.observe(expected, seconds["loop"] + seconds["full"])

    # -- one generation, both decoders ----------------------------------------------------------------
    def quality(self, folder: Folder, cand: Candidate) -> dict:
        rec = self.store.get("quality", cand.generation)
        if rec is None:
            if not self.searching():
                return {"skipped": "time budget"}
            try:
                out = generate(folder.pipe(cand.profile), cand, self.prompts, self.guidance)
            except UserError as e:
                rec = self.store.put("quality", cand.generation, {"error": str(e)})
            else:
                rec = self.record(cand, out)
                self._observe(cand, out["seconds"])
                self._checked_share()
            self.evaluated += 1
            self._say(cand, rec)
        return rec

    def record(self, cand: Candidate, out: dict) -> dict:
        """Score one generation's images (measure.generate's result) through both decoders and keep the result."""
        n = len(self.prompts.prompts)
        tiny = None if out["tiny"] is None else score(out["tiny"], self.reference, self.prompts, self.judged)
        return self.store.put("quality", cand.generation, {
            "candidate": cand.with_(decoder="full").to_dict(),
            "full": score(out["full"], self.reference, self.prompts, self.judged), "tiny": tiny,
            "per_image_s": {k: v / n for k, v in out["seconds"].items()}})

    def _say(self, cand: Candidate, rec: dict) -> None:
        if "error" in rec:
            self.log(f"tune: {cand.label()}: does not apply ({rec['error'][:120]})")
            return
        parts = []
        for dec in ("full", "tiny"):
            s = rec.get(dec)
            if s:
                acc = f", strict {s['strict']:.2f}" if s.get("strict") is not None else ""
                parts.append(f"{dec} {s['psnr']:.1f} dB{acc} {'passes' if self.bound.passes(s) else 'misses'}")
        self.log(f"tune [{self.elapsed():5.0f}s]: {cand.with_(decoder='full').label()}: {'; '.join(parts)}")

    def passed(self, rec: dict) -> bool:
        return "error" not in rec and "skipped" not in rec and (
            self.bound.passes(rec.get("full")) or self.bound.passes(rec.get("tiny")))

    # -- the stages -------------------------------------------------------------------------------------
    def share(self, cand: Candidate) -> float:
        """What the candidate's pictures cost vs the reference's (the quality pass's seconds; 1 when unknown)."""
        base, rec = self.store.get("quality", self.default.generation), self.store.get("quality", cand.generation)
        if not base or not rec or "per_image_s" not in base or "per_image_s" not in rec:
            return 1.0
        return estimate(cand, rec) / estimate(self.default, base)

    def _checked_share(self) -> None:
        """What the checked candidate's pictures cost vs the reference's: the fastest that passed so far (the walk
        confirms the fastest first; a further confirmation is weighed at its own cost, finish.confirmer; the
        default's checks cost their references alone), a generation's cost (both decoders come of one). Where the
        bound reads the judge, only among those at or above the most the PSNR floor can ask: the floor is read
        after the search, and r6's keep run held back the checks at the cost of a 4-step point it then turned down
        (35 s for the checks against the 214 s the chosen 12-step point took)."""
        from .accuracy import FLOOR_CAP

        floor = self.bound.psnr_floor if self.bound.psnr_floor is not None else (
            FLOOR_CAP if self.bound.keep_accuracy else None)
        shares = [self.share(c.with_(decoder="full")) for c, s, _ in self.passing(None)
                  if c.generation != self.default.generation and (floor is None or s["psnr"] >= floor)]
        self.budget.checked_share = min((x for x in shares if x < 1.0), default=0.0)

    def sampling_stage(self, folder: Folder, profile: str, allowed=None, quick: bool = False) -> list[tuple[str, int]]:
        """(sampler, steps) points that pass without a cache; `allowed`: only these (a quantized folder); `quick`:
        the folder's own sampler only."""
        d = self.default
        points = []
        for sampler in (d.sampler,) if quick else samplers(d.sampler):
            for steps in step_counts(d.steps):
                if allowed is not None and (sampler, steps) not in allowed:
                    continue
                rec = self.quality(folder, Candidate(folder.recipe, sampler, steps, None, "full", profile))
                if "error" in rec or not self.passed(rec):
                    break  # does not apply, out of time, or missed: fewer steps only lose more
                points.append((sampler, steps))
        return points

    def cache_stage(self, folder: Folder, profile: str, points, allowed=None) -> list[tuple[str, int, str]]:
        passed, invalid, missed = [], set(), set()
        for sampler, steps in points:  # each sampler's step counts come most first
            for cache in CACHES:
                if cache in invalid or (sampler, cache) in missed or (
                        allowed is not None and (sampler, steps, cache) not in allowed):
                    continue
                rec = self.quality(folder, Candidate(folder.recipe, sampler, steps, cache, "full", profile))
                if "error" in rec:
                    invalid.add(cache)
                elif self.passed(rec):
                    passed.append((sampler, steps, cache))
                else:
                    missed.add((sampler, cache))  # with fewer steps it only loses more
        return passed

    def note(self, text: str) -> None:
        if text not in self.notes:  # a second pass over a folder says it once
            self.notes.append(text)

    def run_folder(self, folder: Folder, fp32_points=None, fp32_cached=None, quick: bool = False) -> tuple[list, list]:
        """`quick`: the folder's own sampler down its steps, no cache (the fp32 folder's first pass, before a
        quantize build)."""
        points, cached = [], []
        for profile in folder.profiles:
            if fp32_points is not None:  # a quantized folder: its own sampler and steps first
                d = self.default
                rec = self.quality(folder, Candidate(folder.recipe, d.sampler, d.steps, None, "full", profile))
                if "skipped" in rec:
                    self.note(f"{folder.recipe} on {profile}: built, but the search's part of the time budget was "
                               "spent before its first point")
                    continue
                if not self.passed(rec):
                    self.note(f"{folder.recipe} on {profile}: misses the bound at {d.sampler} {d.steps} already; its "
                               "other points were not tried")
                    continue
            p = self.sampling_stage(folder, profile, None if fp32_points is None else set(fp32_points), quick)
            c = [] if quick else self.cache_stage(folder, profile, p, None if fp32_cached is None else set(fp32_cached))
            points += p
            cached += c
        return points, cached

    # -- what passed ----------------------------------------------------------------------------------------
    def scored(self, recipes) -> list[tuple[Candidate, dict, dict]]:
        """(candidate, its score, its quality record) for every measured candidate of `recipes`' folders (None:
        every folder's), both decoders of each generation (this run's measurements and the store's)."""
        out = []
        for (kind, _), rec in self.store.records.items():
            if kind != "quality" or "candidate" not in rec:
                continue
            base = Candidate.from_dict(rec["candidate"])
            if recipes is not None and base.recipe not in recipes:
                continue
            for dec in ("full", "tiny"):
                s = rec.get(dec)
                if s is not None:
                    out.append((base.with_(decoder=dec), s, rec))
        return out

    def passing(self, recipes) -> list[tuple[Candidate, dict, dict]]:
        """`scored`, within the bound."""
        return [row for row in self.scored(recipes) if self.bound.passes(row[1])]


def estimate(cand: Candidate, rec: dict) -> float:
    """Seconds per image in the quality pass (batched): a pre-ranking only, the latency is timed."""
    s = rec["per_image_s"]
    return s["loop"] + s[cand.decoder]
