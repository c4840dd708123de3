"""MagCache (transformers), ``magcache:THRESHOLD[:MAX_SKIP[:RETENTION]]`` or, in Python,
``{"method": "magcache", "threshold": T, "max_skip_steps": K, "retention_ratio": R, "mag_ratios": [...]}``.

diffusers' ``MagCacheConfig`` semantics (defaults 0.06, 3, 0.2; Ma et al. 2025): every transformer block is
skipped on a step whose accumulated magnitude drift is small. Each step multiplies a running ratio by the
model's calibrated magnitude ratio for that step (||r_i|| / ||r_{i-1}||), adds |1 - ratio| to a running error,
and skips while that error stays under THRESHOLD and at most MAX_SKIP steps in a row were skipped; the first
round(RETENTION * steps) steps always run. A skipped step adds the last computed residual (all blocks' output
minus the first block's hidden input) to this step's hidden input. diffusers keeps the ratios as float32, so
the running ratio and error are float32 and THRESHOLD is compared after rounding to float32, host and graph.

The ratios are measured once per model (``onnxdiffusion cache calibrate MODEL``: `calibrate` below, stored
in the folder's manifest under ``magcache``) or given as ``mag_ratios``; `bind` resamples them to a run's
step count as diffusers does. Loop-graph inputs of its own: ``cache_mag_ratios`` (float, one per step) and
``cache_retention`` (int64); ``cache_threshold`` is THRESHOLD, ``cache_interval`` MAX_SKIP.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..errors import UserError
from ..fields import option
from .cache_base import FLOAT, INT64, CacheSpec, GraphStep, Policy, same_shape

MANIFEST_KEY = "magcache"  # {"ratios": [...], "steps": N, "sampler": ..., "guidance": ..., "prompts": K}
KEYS = ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios")
NEVER = np.iinfo(np.int64).max  # a retention no step reaches: nothing skipped
# generic scene prompts: the ratios describe the backbone's dynamics, not a prompt's content
DEFAULT_PROMPTS = ("a red circle above a blue square", "a photo of a cat on a green sofa",
                   "a yellow triangle left of a purple star", "a mountain lake at sunset, detailed")

# --- the shared float32 arithmetic (host policy; the Loop graph twins it op for op) ----------------------
def nearest_interp(ratios, n: int) -> np.ndarray:
    """The ratios resampled to `n` steps by nearest index (diffusers' ``nearest_interp``: float32 grid, round
    half to even; one step takes the last ratio)."""
    src = np.asarray(ratios, np.float32).reshape(-1)
    if n == 1:
        return src[-1:].copy()
    scale = np.float32((len(src) - 1) / (n - 1))
    return src[np.round(np.arange(n, dtype=np.float32) * scale).astype(np.int64)]

def retention_steps(retention_ratio: float, n: int) -> int:
    """How many first steps always run (diffusers: int(ratio * steps + 0.5))."""
    return int(retention_ratio * n + 0.5)

def step(state: tuple, scale: np.float32, threshold: np.float32, max_skip: int, has_residual: bool):
    """One step past the retention steps: (skip, the new (ratio, skipped steps, error)); a computed step resets."""
    ratio, count, err = state
    ratio = np.float32(ratio * scale)
    count += 1
    err = np.float32(err + np.abs(np.float32(1.0) - ratio))
    if has_residual and err <= threshold and count <= max_skip:
        return True, (ratio, count, err)
    return False, (np.float32(1.0), 0, np.float32(0.0))

def skip_schedule(scales, threshold: float, max_skip: int, retention: int) -> list[bool]:
    """Per step, whether the blocks are skipped (`scales` resampled to the run's steps). The decision reads no
    tensor, so the host knows the whole schedule before the first step."""
    thr = np.float32(threshold)
    state, out = (np.float32(1.0), 0, np.float32(0.0)), []
    for i, s in enumerate(np.asarray(scales, np.float32)):
        skip = False
        if i >= retention:  # step 0 always runs: no residual yet
            skip, state = step(state, s, thr, max_skip, i > 0)
        out.append(skip)
    return out

def magnitude_ratio(residual: np.ndarray, previous: np.ndarray | None) -> float:
    """Calibration: mean over tokens of ||r_i|| / (||r_{i-1}|| + 1e-8), norms over the last axis in float32
    (diffusers' calibration mode); 1.0 for the first step."""
    if previous is None:
        return 1.0
    cur = np.linalg.norm(residual.astype(np.float32), axis=-1)
    prev = np.linalg.norm(previous.astype(np.float32), axis=-1)
    return float(np.mean(cur / (prev + np.float32(1e-8)), dtype=np.float32))

# --- the spec -------------------------------------------------------------------------------------------
def _bad(spec, why: str) -> UserError:
    return UserError(f"cache spec {spec!r}: {why} (expected {MagCache.usage}, THRESHOLD >= 0, MAX_SKIP an "
                     "integer >= 0, RETENTION in [0, 1])")

def _checked(spec, threshold, max_skip, retention) -> tuple[float, int, float]:
    try:
        t, r = float(threshold), float(retention)
        k = max_skip if isinstance(max_skip, int) and not isinstance(max_skip, bool) else int(str(max_skip))
    except (TypeError, ValueError):
        raise _bad(spec, "not numbers") from None
    if not math.isfinite(t) or t < 0:
        raise _bad(spec, "THRESHOLD must be a number >= 0")
    if k < 0:
        raise _bad(spec, "MAX_SKIP must be >= 0")
    if not 0.0 <= r <= 1.0:
        raise _bad(spec, "RETENTION must be in [0, 1]")
    return t, k, r

def check_ratios(ratios, where: str) -> tuple[float, ...]:
    """Finite positive numbers, at least one: else a one-line UserError."""
    try:
        values = np.asarray(ratios, np.float64).reshape(-1) if not isinstance(ratios, (str, bytes, dict)) else None
    except (TypeError, ValueError):
        values = None
    if values is None or values.size == 0 or not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise UserError(f"{where} must be a non-empty list of finite numbers > 0")
    return tuple(float(v) for v in values)

def stored_ratios(manifest: dict, folder) -> tuple[float, ...]:
    """The folder's calibrated ratios, or a one-line UserError saying how to get them."""
    record = manifest.get(MANIFEST_KEY)
    if record is None:
        raise UserError(f"cache magcache: {folder} has no MagCache ratios; run `onnxdiffusion cache calibrate "
                        f"{folder}` once (or give mag_ratios explicitly)")
    if not isinstance(record, dict):
        raise UserError(f"{folder}: manifest field {MANIFEST_KEY} must be an object")
    return check_ratios(record.get("ratios"), f"{folder}: manifest field {MANIFEST_KEY}.ratios")

@dataclass(frozen=True)
class MagCache(CacheSpec):
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple[float, ...] | None = None  # explicit ratios (any length); None: the folder's
    calibrate: bool = False  # never skip; the ratios measured go to `recorder`
    scales: tuple[float, ...] | None = None  # the ratios resampled to this run's steps (bind)
    recorder: list | None = field(default=None, compare=False, repr=False)

    method: ClassVar[str] = "magcache"
    usage: ClassVar[str] = "magcache:THRESHOLD[:MAX_SKIP[:RETENTION]]"
    max_args: ClassVar[int] = 3
    prunes_first: ClassVar[bool] = True  # a skipped step reads the first piece's image stream only

    @classmethod
    def parse_args(cls, spec: str, args: list[str]) -> "MagCache":
        d = cls()
        return cls(*_checked(spec, args[0], args[1] if len(args) > 1 else d.max_skip_steps,
                             args[2] if len(args) > 2 else d.retention_ratio))

    @classmethod
    def from_dict(cls, values: dict) -> "MagCache":
        """diffusers' MagCacheConfig keys."""
        unknown = sorted(set(values) - set(KEYS) - {"method"})
        if unknown:
            raise UserError(f"cache {{'method': 'magcache', ...}}: unknown key {unknown[0]!r}; expected {', '.join(KEYS)}")
        d = cls()
        t, k, r = _checked(values, values.get("threshold", d.threshold), values.get("max_skip_steps", d.max_skip_steps),
                           values.get("retention_ratio", d.retention_ratio))
        ratios = values.get("mag_ratios")
        return cls(t, k, r, None if ratios is None else check_ratios(ratios, "cache magcache: mag_ratios"))

    @classmethod
    def compiled_default(cls) -> "MagCache":
        """The structure only (nothing in it depends on the settings): a spec that skips nothing, as the other
        methods' bare defaults; generate --cache picks the settings per run."""
        return cls(max_skip_steps=0)

    @property
    def noop(self) -> bool:
        return self.max_skip_steps == 0 and not self.calibrate

    def __str__(self) -> str:
        return f"magcache:{self.threshold:g}:{self.max_skip_steps}:{self.retention_ratio:g}"

    def span_args(self) -> dict:
        return {"all_blocks": True}  # a skipped step skips every block

    def bind(self, pipe, steps: int) -> "MagCache":
        """The ratios (explicit, else the folder's) resampled to this run's `steps`."""
        if self.noop or self.calibrate:
            return self
        ratios = self.mag_ratios if self.mag_ratios is not None else stored_ratios(pipe.manifest, pipe.folder)
        return dataclasses.replace(self, scales=tuple(float(v) for v in nearest_interp(ratios, steps)))

    def graph_inputs(self) -> list[tuple[str, int, list, np.ndarray]]:
        return [("cache_mag_ratios", FLOAT, ["cache_steps"], np.ones(1, np.float32)),
                ("cache_retention", INT64, [], np.array(NEVER, np.int64))]

    def loop_feeds(self) -> dict[str, np.ndarray]:
        """The Loop graph's inputs; unbound (no run yet): the scalars only."""
        if self.calibrate:
            raise UserError("MagCache calibration runs in the host loop (onnxdiffusion cache calibrate)")
        feeds = {"cache_threshold": np.array(self.threshold, np.float64),
                 "cache_interval": np.array(self.max_skip_steps, np.int64)}
        if self.scales is not None:
            feeds["cache_mag_ratios"] = np.asarray(self.scales, np.float32)
            feeds["cache_retention"] = np.array(retention_steps(self.retention_ratio, len(self.scales)), np.int64)
        return feeds

    def policy(self) -> Policy:
        return _Policy(self)

    def graph_state(self, b, span_type: int) -> list[tuple[str, int, str]]:
        b.const("cache_one_f", np.array(1.0, np.float32))
        return [("cache_zero_f", FLOAT, "cache_residual"), ("cache_one_f", FLOAT, "cache_ratio"),
                ("cache_zero_i64", INT64, "cache_count"), ("cache_zero_f", FLOAT, "cache_err")]

    def graph_step(self, s: GraphStep) -> tuple[str, str]:
        """`step` above as graph ops: the carried ratio, count and error move past the retention steps and
        reset on a computed step; the If runs every block or adds the carried residual."""
        b, i = s.b, s.i
        hidden = s.got[s.sg.hidden_in[0]]
        last = b.op("Sub", [b.op("Size", ["cache_mag_ratios"], "cache_mag_n"), "cache_one_i64"], "cache_mag_last")
        scale = b.op("Gather", ["cache_mag_ratios", b.op("Min", [i, last], "cache_mag_at")], "cache_mag_scale", axis=0)
        ratio = b.op("Mul", ["cache_ratio_in", scale], "cache_mag_ratio")
        count = b.op("Add", ["cache_count_in", "cache_one_i64"], "cache_mag_count")
        drift = b.op("Abs", [b.op("Sub", ["cache_one_f", ratio], "cache_mag_dev")], "cache_mag_absdev")
        err = b.op("Add", ["cache_err_in", drift], "cache_mag_err")
        small = b.op("LessOrEqual", [err, b.op("Cast", ["cache_threshold"], "cache_mag_threshold", to=FLOAT)],
                     "cache_mag_small")
        room = b.op("LessOrEqual", [count, "cache_interval"], "cache_mag_room")
        have = b.op("Greater", [i, "cache_zero_i64"], "cache_mag_have")  # step 0 ran: a residual is carried
        ok = b.op("And", [b.op("And", [have, small], "cache_mag_have_small"), room], "cache_mag_ok")
        active = b.op("GreaterOrEqual", [i, "cache_retention"], "cache_mag_active")
        skip = b.op("And", [active, ok], "cache_mag_skip")
        reset = b.op("And", [active, b.op("Not", [ok], "cache_mag_not_ok")], "cache_mag_reset")
        for new, carried, start, name in ((ratio, "cache_ratio_in", "cache_one_f", "cache_ratio_out"),
                                          (count, "cache_count_in", "cache_zero_i64", "cache_count_out"),
                                          (err, "cache_err_in", "cache_zero_f", "cache_err_out")):
            moved = b.op("Where", [active, new, carried], f"{name}_moved")
            b.op("Identity", [b.op("Where", [reset, start, moved], f"{name}_next")], name)
        full = b.op("Not", [skip], "cache_full")

        def compute(sub) -> list[str]:
            out = s.run_rest(sub)
            return [out, sub.op("Sub", [out, hidden], "cache_new_residual")]

        def reuse(sub) -> list[str]:
            return [sub.op("Add", [hidden, "cache_residual_in"], "cache_reused"), "cache_residual_in"]

        span, _ = s.switch(full, compute, reuse, ["cache_span", "cache_residual_out"], [FLOAT, FLOAT])
        return full, span

class _Policy(Policy):
    """Every block skipped where the schedule says, the last computed residual added to this step's hidden
    input; in calibration every step runs and its residual's magnitude ratio to the previous one is recorded."""

    def __init__(self, spec: MagCache):
        if not spec.calibrate and spec.scales is None:
            raise UserError(f"cache {spec}: no ratios bound to this run (MagCache.bind)")
        self.spec, self.hidden, self.residual = spec, None, None
        self.schedule = [] if spec.calibrate else skip_schedule(
            spec.scales, spec.threshold, spec.max_skip_steps, retention_steps(spec.retention_ratio, len(spec.scales)))

    def skips(self, step: int) -> bool:
        return self.residual is not None and step < len(self.schedule) and self.schedule[step]

    def reuse(self, step: int, f: dict, sg) -> np.ndarray | None:
        return f[self.hidden] + self.residual if self.skips(step) else None

    def update(self, step: int, f: dict, out: np.ndarray, sg) -> None:
        if self.hidden is None:
            self.hidden = same_shape(sg.hidden_in, f, out.shape)
        residual = out - f[self.hidden]
        if self.spec.recorder is not None:
            self.spec.recorder.append(magnitude_ratio(residual, self.residual))
        self.residual = residual

# --- calibration: the ratios measured once per model, recorded in its manifest ---------------------------
@dataclass(frozen=True)
class CalibrateOptions:
    """The `cache calibrate` verb's options: `calibrate(pipe, read_prompts(o.prompts), steps=o.steps, ...)`."""
    prompts: Path | None = option(None, "prompts file, one a line (default: 4 built-in prompts)")
    steps: int | None = option(None, "steps of each calibration run (default: the model's)")
    sampler: str | None = option(None, "sampler of the runs (default: the model's)")
    guidance: float | None = option(None, "guidance scale of the runs (default: the model's)")
    threads: int | None = option(None, "ONNX Runtime threads")


def read_prompts(path: Path | None) -> list[str]:
    """One prompt a line (blank lines skipped); none given: DEFAULT_PROMPTS."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    prompts = [s.strip() for s in lines if s.strip()]
    if not prompts:
        raise UserError(f"prompts file {path} has no prompt (one a line)")
    return prompts

def measure(pipe, prompts: list[str], steps: int | None = None, sampler: str | None = None,
            guidance: float | None = None, seed: int = 0) -> dict:
    """The per-step ratios of `pipe`'s backbone averaged over `prompts` (one uncached host-loop run each):
    the manifest record."""
    runs, settings = [], {}
    kw = {n: v for n, v in (("steps", steps), ("sampler", sampler), ("guidance", guidance)) if v is not None}
    for k, prompt in enumerate(prompts):
        got: list[float] = []
        settings = pipe(prompt, seed=seed + k, loop="host", cache=MagCache(calibrate=True, recorder=got), **kw).settings
        runs.append(got)
    if len({len(r) for r in runs}) != 1 or not runs[0]:
        raise UserError("cache calibrate: the runs evaluated the model a different number of times")
    ratios = np.mean(np.asarray(runs, np.float64), axis=0)
    return {"ratios": [round(float(v), 6) for v in ratios], "steps": len(runs[0]), "sampler": settings["sampler"],
            "guidance": float(settings["guidance"]), "prompts": len(prompts)}

def calibrate(pipe, prompts: list[str], steps: int | None = None, sampler: str | None = None,
              guidance: float | None = None) -> dict:
    """Measure the ratios of the model `pipe` was loaded from and record them in its folder's manifest (the
    caller loads it: runtime/ stays above techniques/); returns the record."""
    import json

    from ..folder.artifacts import MANIFEST, write_json

    record = measure(pipe, prompts, steps, sampler, guidance)
    path = Path(pipe.folder) / MANIFEST
    raw = json.loads(path.read_text(encoding="utf-8"))  # as written: no defaults of the validator added
    raw[MANIFEST_KEY] = record
    write_json(path, raw)  # a temporary file renamed over the manifest: never half written
    return record
