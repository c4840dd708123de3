"""Calibration data: backbone feeds recorded from fp32 sampling runs, and activation ranges.

The capture wraps the guided backbone the host loop calls, so every step records what the
backbone really sees: the doubled batch [uncond; cond], that step's timestep, and the fp32
output (kept for the sampler-side correction). Per-step ranges are reduced on the fly, then
aggregated over any set of steps (all of them for int8-static, one group's for int8-timestep).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..evaluate import scenes as S
from ..errors import UserError
from . import files
from .configs import MIN_CALIBRATION_PROMPTS, CalibrationConfig, Int8NaiveRecipe


def load_prompts(cfg: CalibrationConfig) -> tuple[list[str], dict]:
    """The calibration prompts and where they came from; fails before any model runs."""
    if cfg.prompts_file is None:
        prompts = [sc.caption for sc in S.scenes("calib", cfg.count)]
        return prompts, {"source": "scenes:calib", "count": cfg.count}
    path = Path(cfg.prompts_file)
    if not path.is_file():
        raise UserError(f"calibration prompt file not found: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read calibration prompt file {path}: {e}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"calibration prompt file is empty: {path}")
    if len(prompts) < MIN_CALIBRATION_PROMPTS:
        raise UserError(f"too few calibration samples: {path} has {len(prompts)} prompts, need >= {MIN_CALIBRATION_PROMPTS}")
    prompts = prompts[: cfg.count] if len(prompts) > cfg.count else prompts
    return prompts, {"source": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "count": len(prompts)}


@dataclass
class CalibrationSet:
    """Backbone feeds over whole trajectories.

    samples (steps, rows, C, H, W) and outputs (same, fp32) per step; context (rows, seq, dim);
    timesteps (steps,); extras: the family's other conditioning inputs (rows, ...) by input name. Row r of every step belongs to context row r: for each prompt chunk the
    rows are [uncond...; cond...], as the guided backbone batches them.
    """

    samples: np.ndarray
    timesteps: np.ndarray
    context: np.ndarray
    outputs: np.ndarray | None = None
    provenance: dict = field(default_factory=dict)
    # fp32 trajectories: latents (steps + 1, prompts, C, H, W), the first row before scaling by the
    # table's init_scale; pairs (prompts, 2): each prompt's (uncond row, cond row), uncond -1 when unguided
    latents: np.ndarray | None = None
    pairs: np.ndarray | None = None
    guidance: float = 1.0
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def conditioning(self, rows: slice | np.ndarray = slice(None)) -> dict[str, np.ndarray]:
        """Every conditioning input of the backbone for these rows."""
        out = {"encoder_hidden_states": np.ascontiguousarray(self.context[rows])}
        out.update({k: np.ascontiguousarray(v[rows]) for k, v in self.extras.items()})
        return out

    @property
    def num_steps(self) -> int:
        return int(self.samples.shape[0])

    @property
    def rows(self) -> int:
        return int(self.samples.shape[1])

    def feed(self, step: int, rows: slice | np.ndarray = slice(None)) -> dict[str, np.ndarray]:
        x = np.ascontiguousarray(self.samples[step, rows])
        return {
            "sample": x,
            "timestep": np.full((len(x),), self.timesteps[step], np.float32),
            **self.conditioning(rows),
        }

    def feeds(self, steps=None, chunk: int = 64):
        """Every (step, row chunk) feed, steps in trajectory order."""
        for s in range(self.num_steps) if steps is None else steps:
            for start in range(0, self.rows, chunk):
                yield s, self.feed(s, slice(start, start + chunk))

    def spread_steps(self, n: int) -> list[int]:
        """n step indices spread evenly over the trajectory (first and last included)."""
        n = max(1, min(n, self.num_steps))
        return sorted({int(round(v)) for v in np.linspace(0, self.num_steps - 1, n)})


def capture(pipe, prompts: list[str], cfg: CalibrationConfig, progress: bool = False) -> CalibrationSet:
    """Run the fp32 pipeline over the prompts (seed cfg.seed + i for prompt i) and record every backbone call."""
    from ..evaluate.run import item_latents
    from ..runtime.pipeline import GenerateOptions
    from ..samplers import sample

    table = pipe.table(GenerateOptions(steps=cfg.steps, sampler=cfg.sampler))
    if table.needs_noise:
        raise UserError(f"calibrate with a deterministic sampler (ddim, euler, dpmpp_2m), not {cfg.sampler}")
    shape = pipe.latent_shape_for(1)[1:]
    steps_x, steps_out, contexts, trajectories, pairs = [], [], [], [], []
    rows = 0
    for start in range(0, len(prompts), cfg.batch):
        chunk = prompts[start : start + cfg.batch]
        seeds = [cfg.seed + start + i for i in range(len(chunk))]
        latents = item_latents(shape, seeds)
        # the family's whole conditioning (SDXL: pooled text and size ids; Flux: its guidance input),
        # negative prompt ""
        height, width = pipe.image_size(GenerateOptions())
        gb = pipe.guided_backbone(chunk, [""] * len(chunk), cfg.guidance, height, width, latents.shape)
        xs, outs = [], []

        def model_fn(x, t, gb=gb, xs=xs, outs=outs):
            result = gb(x, t)
            xs.append(gb.sample.copy())
            outs.append(gb.out.copy())
            return result

        xs_traj = [latents.copy()]
        sample(model_fn, latents, table, callback=lambda i, x, den, xs_traj=xs_traj: xs_traj.append(x.copy()))
        steps_x.append(np.stack(xs))
        steps_out.append(np.stack(outs))
        contexts.append({k: v.copy() for k, v in gb.conditioning.items()})
        trajectories.append(np.stack(xs_traj))
        b = len(chunk)
        for i in range(b):
            pairs.append((rows + i, rows + b + i) if gb.guided else (-1, rows + i))
        rows += gb.context.shape[0]
    joined = {k: np.concatenate([c[k] for c in contexts], axis=0) for k in contexts[0]}
    return CalibrationSet(
        samples=np.concatenate(steps_x, axis=1),
        timesteps=table.timesteps.astype(np.float32).copy(),
        context=joined.pop("encoder_hidden_states"),
        extras=joined,
        outputs=np.concatenate(steps_out, axis=1),
        latents=np.concatenate(trajectories, axis=1),
        pairs=np.asarray(pairs, np.int64),
        guidance=float(pipe.family.cfg_scale(cfg.guidance)),  # the CFG scale the trajectories ran at
        provenance={
            "kind": "trajectories",
            "prompts": list(prompts),
            "seeds": [cfg.seed + i for i in range(len(prompts))],
            "sampler": cfg.sampler,
            "steps": cfg.steps,
            "guidance": cfg.guidance,
            "negative_prompt": "",
            "timesteps": [float(t) for t in table.timesteps],
            "backbone_calls": int(cfg.steps * -(-len(prompts) // cfg.batch)),
            "rows_per_step": int(rows),
        },
    )


def naive_set(pipe, recipe: Int8NaiveRecipe, seed: int) -> CalibrationSet:
    """What a tutorial does: N(0,1) latents at one timestep, N(0,1) "text embeddings"."""
    rng = np.random.default_rng(seed)
    shape = pipe.latent_shape_for(recipe.samples)
    # the real conditioning's shapes (sequence length included), filled with N(0,1)
    from ..runtime.pipeline import GenerateOptions

    real, _ = pipe.conditioning([""] * recipe.samples, None, False, *pipe.image_size(GenerateOptions()))
    cond = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in real.items()}
    return CalibrationSet(
        samples=rng.standard_normal((1, *shape), dtype=np.float32),
        timesteps=np.array([recipe.timestep], np.float32),
        context=cond.pop("encoder_hidden_states"),
        extras=cond,
        provenance={"kind": "random", "seed": seed, "samples": recipe.samples, "timestep": recipe.timestep,
                    "distribution": "standard normal latents and text embeddings"},
    )


# --- ranges --------------------------------------------------------------------------------

@dataclass
class StepRanges:
    """Per-step min and max of each calibrated tensor: arrays (steps, tensors)."""

    tensors: list[str]
    lo: np.ndarray
    hi: np.ndarray

    def aggregate(self, steps=None, how: str = "max") -> dict[str, tuple[float, float]]:
        idx = np.arange(self.lo.shape[0]) if steps is None else np.asarray(list(steps))
        lo, hi = self.lo[idx], self.hi[idx]
        if how == "max":
            a, b = lo.min(0), hi.max(0)
        elif how == "mean":
            a, b = lo.mean(0), hi.mean(0)
        else:
            raise ValueError(f"unknown aggregation {how!r}")
        # every range must hold 0 exactly (ORT does the same), in float32
        a, b = np.minimum(a, 0.0).astype(np.float32), np.maximum(b, 0.0).astype(np.float32)
        return {t: (float(a[i]), float(b[i])) for i, t in enumerate(self.tensors)}


# rows per statistics call for a > 2 GB backbone: one prompt's [uncond; cond]. ORT's arena still grew by
# ~4 GB over the plain backbone's on a batch-8 SD1.5 stats call; min, max and histogram counts add up
# exactly over any split of the rows, so smaller calls cost time only.
LARGE_CHUNK = 2


def step_ranges(model: onnx.ModelProto, tensors: list[str], calib: CalibrationSet, threads: int = 1,
                chunk: int = 64) -> StepRanges:
    """Each tensor's (min, max) per step, reduced inside the graph (stats.minmax_model): a call holds
    the backbone's own activations only, whatever the number of calibrated tensors."""
    from ..onnxio.session import session
    from .stats import collect_minmax, minmax_model

    chunk = min(chunk, LARGE_CHUNK) if files.is_large(model) else chunk
    aug, outs = minmax_model(model, tensors)
    sess = session(aug, threads, stats=True)
    del aug
    lo, hi = collect_minmax(sess, outs, calib.feeds(chunk=chunk), calib.num_steps)
    return StepRanges(list(tensors), lo, hi)


def histogram_ranges(model: onnx.ModelProto, tensors: list[str], stats: StepRanges, calib: CalibrationSet,
                     method: str, num_bins: int, percentile: float, steps=None, threads: int = 1,
                     chunk: int = 64) -> dict[str, tuple[float, float]]:
    """Entropy or percentile ranges from histograms streamed batch by batch (in-graph, fixed range).

    The range of each tensor's histogram comes from its min/max over the same steps (`stats`), so
    it is the histogram ONNX Runtime's calibrator builds when its first batch holds the extremes:
    [-m, m] (m = max |x|) for entropy, |x| over [0, m] for (symmetric) percentile; the thresholds
    are then ORT's own (_ort.histogram_thresholds)."""
    from . import _ort
    from ..onnxio.session import session
    from .stats import collect_histograms, histogram_model

    chunk = min(chunk, LARGE_CHUNK) if files.is_large(model) else chunk
    agg = stats.aggregate(steps, "max")
    peak = {t: max(abs(agg[t][0]), abs(agg[t][1])) for t in tensors}
    absolute = method == "percentile"
    bounds = [(0.0, peak[t]) if absolute else (-peak[t], peak[t]) for t in tensors]
    aug, outs = histogram_model(model, tensors, bounds, num_bins, absolute=absolute)
    sess = session(aug, threads, stats=True)
    del aug
    counts = collect_histograms(sess, outs, (feed for _, feed in calib.feeds(steps=steps, chunk=chunk)))
    hists = {t: (counts[i], np.linspace(lo, hi, num_bins + 1).astype(np.float32), agg[t][0], agg[t][1])
             for i, (t, (lo, hi)) in enumerate(zip(tensors, bounds))}
    return _ort.histogram_thresholds(hists, method, num_bins, percentile)


def timestep_groups(stats: StepRanges, k: int, how: str = "optimal") -> list[list[int]]:
    """Split the steps (trajectory order) into k contiguous groups.

    "optimal" minimizes the total inflation sum over steps and tensors of log(group range / step
    range): the resolution each step loses by sharing its group's scale (dynamic programming).
    """
    n = stats.lo.shape[0]
    if k > n:
        raise UserError(f"groups (K={k}) exceed the {n} calibration steps")
    if how == "equal":
        edges = np.linspace(0, n, k + 1).round().astype(int)
        return [list(range(edges[i], edges[i + 1])) for i in range(k)]
    width = np.maximum(stats.hi - stats.lo, 1e-12).astype(np.float64)
    log_w = np.log(width)

    def cost(a: int, b: int) -> float:  # steps a..b-1 share one range
        lo, hi = stats.lo[a:b].min(0), stats.hi[a:b].max(0)
        group = np.log(np.maximum(hi - lo, 1e-12).astype(np.float64))
        return float((group[None] - log_w[a:b]).sum())

    c = np.array([[cost(a, b) if b > a else np.inf for b in range(n + 1)] for a in range(n + 1)])
    best = np.full((k + 1, n + 1), np.inf)
    arg = np.zeros((k + 1, n + 1), int)
    best[0, 0] = 0.0
    for g in range(1, k + 1):
        for b in range(g, n + 1):
            vals = [best[g - 1, a] + c[a, b] for a in range(g - 1, b)]
            j = int(np.argmin(vals))
            best[g, b], arg[g, b] = vals[j], j + g - 1
    groups, b = [], n
    for g in range(k, 0, -1):
        a = arg[g, b]
        groups.append(list(range(a, b)))
        b = a
    return groups[::-1]


def group_boundaries(timesteps: np.ndarray, groups: list[list[int]]) -> list[float]:
    """t thresholds between consecutive groups: midpoints between their neighbouring timesteps."""
    out = []
    for g1, g2 in zip(groups, groups[1:]):
        out.append(float((timesteps[g1[-1]] + timesteps[g2[0]]) / 2.0))
    return out
