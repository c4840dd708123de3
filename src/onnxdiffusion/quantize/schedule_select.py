"""Choosing a precision schedule's steps from measured per-step sensitivity (quantize --precision-schedule).

On the calibration prompts (their own seeds, never evaluation's), with the calibration sampler:

1. the fp32 trajectory (every step's state) and its images are the reference;
2. the quantized backbone at every step gives the error to close: pooled image MSE vs fp32, M0;
3. sensitivity of step i: the image MSE when only step i runs the quantized backbone (fp32 before it,
   so it resumes from the recorded fp32 state; fp32 after it);
4. the steps ranked by sensitivity; schedules of the top 1, 2, ... steps are generated in full
   (quantized everywhere else) until one closes `target` of M0, within the latency budget.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..folder.manifest import Manifest
from ..samplers.host import iter_sample_from
from .schedule import PrecisionSchedule, ScheduleConfig


class _Stepper:
    """model_fn(x, t) that runs fns[k] at the k-th call after `start` (a schedule given per step index)."""

    def __init__(self, fns: dict, use_high: list[bool], start: int):
        self.fns, self.use_high, self.k = fns, use_high, start

    def __call__(self, x, t):
        fn = self.fns["high" if self.use_high[self.k] else "low"]
        self.k += 1
        return fn(x, t)


class ScheduleProbe:
    """Calibration prompts generated with any per-step mix of two backbones, from any step on."""

    def __init__(self, pipe, prompts: list[str], seed: int, steps: int, sampler: str, guidance: float, sessions: dict):
        from ..evaluate.run import item_latents
        from ..runtime.pipeline import GenerateOptions

        opts = pipe.resolve(GenerateOptions(steps=steps, sampler=sampler, guidance=guidance, batch=len(prompts)))
        self.pipe, self.table = pipe, pipe.table(opts)
        self.h, self.w = pipe.image_size(opts)
        shape = pipe.latent_shape(opts)
        seeds = [seed + i for i in range(len(prompts))]
        self.latents = item_latents(shape[1:], seeds)
        self.noise = None
        if self.table.needs_noise:
            self.noise = np.random.default_rng(seed).standard_normal((self.table.num_steps, *shape), dtype=np.float32)
        self.fns = {k: pipe.guided_backbone(prompts, None, opts.guidance, self.h, self.w, shape, session=s)
                    for k, s in sessions.items()}
        self.n = self.table.num_steps
        self.states: list | None = None
        self.reference = self.images([True] * self.n, record=True)

    def images(self, use_high: list[bool], start: int = 0, record: bool = False) -> np.ndarray:
        if start == 0:
            x = (self.latents * np.float32(self.table.init_scale)).astype(np.float32)
            d = np.zeros_like(x)
        else:
            x, d = self.states[start]
        states = [(x, d)]
        for _i, x, d in iter_sample_from(_Stepper(self.fns, use_high, start), x, d, self.table, start, self.noise):
            if record:
                states.append((x, d))
        if record:
            self.states = states
        return self.pipe.decode(x, self.h, self.w)

    def mse(self, images: np.ndarray) -> np.ndarray:
        """Per-image MSE vs the fp32 reference (uint8 pixels, as evaluation measures)."""
        diff = images.astype(np.float64) - self.reference.astype(np.float64)
        return (diff ** 2).reshape(len(diff), -1).mean(axis=1)


def latency_budget(low_ms: float, high_ms: float, steps: int, max_latency: float) -> int:
    """Most high-precision steps whose backbone time stays within `max_latency` x the quantized
    backbone's alone (text encoding and decoding not counted: the end-to-end ratio is lower)."""
    extra = high_ms - low_ms
    if extra <= 0:
        return steps
    return max(0, min(steps, math.floor((max_latency - 1.0) * steps * low_ms / extra + 1e-9)))


def select(probe: ScheduleProbe, cfg: ScheduleConfig, component: str, low_ms: float, high_ms: float,
           log=lambda m: None) -> tuple[PrecisionSchedule | None, dict]:
    """The schedule and the measurements behind it. None when chosen automatically and even the
    budget's best closes nothing (or the budget allows no step); a fixed `steps` K is always kept."""
    n, ts = probe.n, probe.table.timesteps
    t0 = time.time()
    m_low = probe.mse(probe.images([False] * n))
    total = float(m_low.sum())
    sensitivity = []
    from tqdm import tqdm

    for i in tqdm(range(n), desc="per-step sensitivity", unit="step", leave=False):
        mask = [True] * n
        mask[i] = False
        sensitivity.append(float(probe.mse(probe.images(mask, start=i)).sum()))
    ranking = [int(i) for i in np.argsort(-np.asarray(sensitivity), kind="stable")]
    budget = latency_budget(low_ms, high_ms, n, cfg.max_latency)
    log(f"precision schedule: quantized MSE {total / len(m_low):.3f}, most sensitive steps {ranking[:6]}, "
        f"latency budget {budget} steps")
    trials = []
    wanted = [cfg.steps] if cfg.steps else list(range(1, budget + 1))
    chosen = None
    for k in wanted:
        high = sorted(ranking[:k])
        m = probe.mse(probe.images([i in high for i in range(n)]))
        closed = 1.0 - float(m.sum()) / total if total > 0 else 0.0
        trials.append({"k": k, "high_steps": high, "closed": round(closed, 4),
                       "images_improved": round(float(np.mean(m < m_low)), 4)})
        log(f"precision schedule: {k} high-precision steps {high}: closes {closed:.1%} of the quantized MSE")
        if chosen is None or closed > chosen["closed"]:
            chosen = trials[-1]
        if not cfg.steps and closed >= cfg.target:
            chosen = trials[-1]
            break
    report = {
        "config": cfg.to_dict(),
        "calibration": {"prompts": len(probe.latents), "steps": n, "sampler": probe.table.sampler},
        "quantized_image_mse": total / len(m_low),
        "sensitivity_image_mse": [{"step": i, "t": float(ts[i]), "mse": s / len(m_low)} for i, s in enumerate(sensitivity)],
        "ranking": ranking,
        "backbone_ms": {"quantized": round(low_ms, 3), "high": round(high_ms, 3)},
        "latency_budget_steps": budget,
        "trials": trials,
        "seconds": round(time.time() - t0, 1),
    }
    if chosen is None or (chosen["closed"] <= 0 and not cfg.steps):  # a fixed K is what was asked for
        report["chosen"] = None
        return None, report
    k = chosen["k"]
    report["chosen"] = chosen | {"target_reached": chosen["closed"] >= cfg.target,
                                 "estimated_backbone_ratio": round((n * low_ms + k * (high_ms - low_ms)) / (n * low_ms), 3)}
    selected = {"steps": n, "sampler": probe.table.sampler, "high_steps": chosen["high_steps"],
                "timesteps": [float(ts[i]) for i in chosen["high_steps"]], "closed_on_calibration": chosen["closed"]}
    return PrecisionSchedule.from_steps(ts, chosen["high_steps"], component, cfg.precision, selected), report


def choose(pipe, low_model, high_model, config, prompts: list[str], manifest: Manifest, component: str,
           log=lambda m: None) -> tuple[PrecisionSchedule | None, dict]:
    """Sessions for both backbones (as the pipeline builds them), their call times at one guided image
    (interleaved medians), then `select` on the calibration prompts."""
    from ..families import get_family
    from .report import component_feed
    from .runner import decision_clock, session, time_sessions

    cfg: ScheduleConfig = config.schedule
    cal = config.calibration
    sessions = {"low": session(low_model, config.threads), "high": session(high_model, config.threads)}
    backbone = get_family(manifest.family).backbone
    # the times set the latency budget (which schedules are tried): a clock the machine's load does not move
    t = time_sessions(sessions, component_feed(backbone, manifest), max(10, config.latency_runs),
                      clock=decision_clock(config.threads))
    use = prompts[:cfg.prompts]
    log(f"precision schedule: {len(use)} calibration prompts x {cal.steps} {cal.sampler} steps; backbone "
        f"{t['low']['median_ms']:.2f} ms quantized, {t['high']['median_ms']:.2f} ms {cfg.precision}")
    probe = ScheduleProbe(pipe, use, cal.seed, cal.steps, cal.sampler, cal.guidance, sessions)
    return select(probe, cfg, component, t["low"]["median_ms"], t["high"]["median_ms"], log)
