"""What `tune` measures: a candidate's pictures against the model's own fp32 reference on fixed prompts and
seeds (mean image PSNR, and the judge's accuracies where the prompts are the scene world's), and its end-to-end
latency here (fresh ONNX Runtime sessions, one image, interleaved rounds, the order rotated each round)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..evaluate import scenes as S
from ..evaluate.metrics import psnr
from ..evaluate.run import item_latents
from ..runtime.generation import GenerationResult
from .space import Candidate

PSNR_CAP = 100.0  # identical pictures: a finite figure a mean and a JSON file can hold


@dataclass(frozen=True)
class PromptSet:
    """Prompts with one seed each (prompt i: seed `seed + i`); `scenes` when the judge can read them."""
    name: str
    prompts: tuple[str, ...]
    seed: int
    scenes: tuple | None = None

    def describe(self) -> dict:
        return {"name": self.name, "count": len(self.prompts), "seed": self.seed, "prompts": list(self.prompts)}


def scene_set(name: str, count: int, start: int) -> PromptSet:
    """`count` held-out scenes from `start` (the tuning and the final held-out sets do not overlap)."""
    sc = tuple(S.scenes("heldout", count, start=start))
    return PromptSet(name, tuple(s.caption for s in sc), start, sc)


def file_set(path: Path, count: int) -> PromptSet:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --prompts {path}: {e}") from None
    prompts = tuple(ln for ln in lines if ln)[:count]
    if not prompts:
        raise UserError(f"--prompts {path} holds no prompt (one a line)")
    return PromptSet("file", prompts, 0)


def per_image_psnr(images: np.ndarray, reference: np.ndarray) -> list[float]:
    """Per-image PSNR in dB, identical images capped at PSNR_CAP."""
    return [min(PSNR_CAP, psnr(a, b)) for a, b in zip(images, reference)]


def mean_psnr(images: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(mean, worst) per-image PSNR in dB."""
    values = per_image_psnr(images, reference)
    return float(np.mean(values)), float(np.min(values))


class Judged:
    """The judge's verdicts on a prompt set's images (None where the prompts are not scenes or no judge)."""

    def __init__(self, judge=None):
        self.judge = judge

    def __call__(self, images: np.ndarray, prompts: PromptSet) -> dict | None:
        if self.judge is None or prompts.scenes is None:
            return None
        from ..evaluate.judge import score_scenes, strict_margins, summarize

        logits = self.judge.logits(images)  # one run of the judge: verdicts and margins both read it
        each = score_scenes(list(prompts.scenes), self.judge.read(logits))
        s = summarize(each)
        # per prompt: the paired test and the PSNR floor (accuracy.py) compare verdicts prompt by prompt; the
        # margins say how near each verdict is to flipping (the confirmation's expected discordance)
        margins = strict_margins(list(prompts.scenes), logits)
        return {"strict": s["strict_accuracy"], "attribute": s["attribute_accuracy"],
                "strict_each": [int(bool(e["strict"])) for e in each],
                "margin_each": [round(m, 4) for m in margins]}


def load_judge():
    from ..evaluate.judge import Judge

    try:
        return Judge.from_file(None)
    except FileNotFoundError:
        return None


def generate(pipe, cand: Candidate, prompts: PromptSet, guidance: float, batch: int = 16, on_batch=None) -> dict:
    """Both decoders' images of one generation (the tiny decoder reads the same final latents), with the seconds
    each part took (a pre-ranking of candidates, not their latency). `on_batch(images, seconds)` after each batch
    (its loop and full decode, as its per_image_s reads them): the time budget re-reads the load from it."""
    full, tiny, t_loop, t_full, t_tiny = [], [], 0.0, 0.0, 0.0
    has_tiny = "vae_decoder_tiny" in pipe.manifest.components
    for start in range(0, len(prompts.prompts), batch):
        chunk = list(prompts.prompts[start:start + batch])
        seeds = [prompts.seed + start + i for i in range(len(chunk))]
        shape = pipe.latent_shape_for(len(chunk))[1:]
        t0 = time.perf_counter()
        # the loop's end read from its last step event, so the full decode is the generation's own (timing it
        # by a second decode of the same latents cost one more VAE decode a batch in every generation)
        t_steps, result = t0, None
        for event in pipe.iter_generate(chunk, steps=cand.steps, sampler=cand.sampler, guidance=guidance,
                                        batch=len(chunk), latents=item_latents(shape, seeds), seed=seeds[0],
                                        cache=cand.cache or "none", decoder="full"):
            if isinstance(event, GenerationResult):
                result = event
            else:
                t_steps = time.perf_counter()
        t1 = time.perf_counter()
        h, w = result.images.shape[1:3]
        full.append(result.images)
        if has_tiny:
            tiny.append(pipe.decode(result.latents, h, w, "tiny"))
        t2 = time.perf_counter()
        t_loop += t_steps - t0
        t_full += t1 - t_steps
        t_tiny += t2 - t1
        if on_batch is not None:
            on_batch(len(chunk), t1 - t0)
    return {"full": np.concatenate(full), "tiny": np.concatenate(tiny) if tiny else None,
            "seconds": {"loop": t_loop, "full": t_full, "tiny": t_tiny}}


def score(images: np.ndarray, reference: np.ndarray, prompts: PromptSet, judged: Judged) -> dict:
    values = per_image_psnr(images, reference)
    out = {"psnr": round(float(np.mean(values)), 3), "psnr_worst": round(float(np.min(values)), 3),
           "psnr_each": [round(float(v), 2) for v in values]}
    verdict = judged(images, prompts)
    if verdict is not None:
        out.update(verdict)
    return out


def time_candidates(loaders: dict, cands: list[Candidate], prompt: str, guidance: float, rounds: int,
                    progress=None, stop=None) -> dict[str, dict]:
    """Median end-to-end seconds of one image per candidate: each candidate's pipeline loaded fresh
    (`loaders[(recipe, profile)]()`), one untimed call each, then `rounds` interleaved rounds, the order
    rotated each round (a load change on this shared machine then hits every candidate alike). `stop(done,
    round_s)` after each round: True ends the timing there (the time budget's call)."""
    pipes = {}
    for c in cands:
        k = (c.recipe, c.profile)
        if k not in pipes:
            pipes[k] = loaders[k]()
    shape = next(iter(pipes.values())).latent_shape_for(1)
    latents = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)

    def once(c: Candidate) -> float:
        t0 = time.perf_counter()
        pipes[(c.recipe, c.profile)](prompt, steps=c.steps, sampler=c.sampler, guidance=guidance, latents=latents,
                                     cache=c.cache or "none", decoder=c.decoder)
        return time.perf_counter() - t0

    for c in cands:
        once(c)
    times: dict[str, list[float]] = {c.key: [] for c in cands}
    for r in range(rounds):
        order = cands[r % len(cands):] + cands[:r % len(cands)]
        t0 = time.perf_counter()
        for c in order:
            times[c.key].append(once(c))
        if progress:
            progress(r + 1, rounds)
        if stop is not None and stop(r + 1, time.perf_counter() - t0):
            break
    return {k: {"median_s": statistics.median(v), "runs": [round(x, 5) for x in v]} for k, v in times.items()}
