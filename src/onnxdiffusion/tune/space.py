"""What `tune` searches: one candidate is a recipe (the folder), a sampler and step count, a step-cache spec,
a decoder and a hardware profile. The levers' values are data here; which of them apply to a folder is found
by trying (a sampler that does not fit a flow schedule, a cache method for another backbone kind: one
UserError each, recorded, never retried)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

FP32 = "fp32"  # the model's own folder, no quantize build
# int8-timestep first: on the embedded models it kept the picture where int8-static did not (issue 46 r3: both
# --min-psnr 35 runs chose it, and it met the --keep-accuracy bound too) and its build took 0.5-0.6x int8-static's;
# int8-static (ORT CPU's fastest, docs/recipes) is built next when time is left
DEFAULT_RECIPES = ("int8-timestep", "int8-static")
# DPM-Solver++ 2M and UniPC reach the folder sampler's picture in fewer steps; ancestral samplers are left out
# (their noise makes the fp32 reference a moving target)
EXTRA_SAMPLERS = ("dpmpp_2m", "unipc")
STEP_FRACTIONS = (1.0, 0.6, 0.4, 0.3, 0.2)  # of the folder's own steps: 20 -> 20, 12, 8, 6, 4
# the step-cache settings the measured comparisons found on the Pareto front (docs/comparisons.md)
CACHES = ("deepcache:3:L1", "deepcache:2:L1", "residual:5:0", "residual:3:0", "taylorseer:3")
DECODERS = ("full", "tiny")
LEVERS = ("recipe", "sampling", "cache", "decoder", "profile")


@dataclass(frozen=True, order=True)
class Candidate:
    recipe: str
    sampler: str
    steps: int
    cache: str | None
    decoder: str
    profile: str

    @property
    def key(self) -> str:
        return "|".join((self.recipe, self.sampler, str(self.steps), self.cache or "none", self.decoder, self.profile))

    @property
    def generation(self) -> str:
        """What a generation depends on before decoding (both decoders are scored from one generation)."""
        return "|".join((self.recipe, self.sampler, str(self.steps), self.cache or "none", self.profile))

    def lever(self, name: str):
        return (self.sampler, self.steps) if name == "sampling" else getattr(self, name)

    def label(self) -> str:
        parts = [self.recipe, f"{self.sampler} {self.steps}"]
        if self.cache:
            parts.append(self.cache)
        if self.decoder != "full":
            parts.append(f"{self.decoder} decoder")
        return ", ".join(parts) + f" [{self.profile}]"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Candidate:
        return cls(d["recipe"], d["sampler"], int(d["steps"]), d.get("cache"), d["decoder"], d["profile"])

    def with_(self, **kw) -> Candidate:
        return replace(self, **kw)


def changed_levers(c: Candidate, default: Candidate) -> tuple[str, ...]:
    return tuple(name for name in LEVERS if c.lever(name) != default.lever(name) and name != "profile")


def step_counts(default_steps: int) -> tuple[int, ...]:
    """The folder's steps first, then fewer (never below 4, never more than the folder's)."""
    counts = [max(4, round(default_steps * f)) for f in STEP_FRACTIONS]
    return tuple(dict.fromkeys(min(c, default_steps) for c in counts))


def samplers(default_sampler: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((default_sampler, *EXTRA_SAMPLERS)))
