"""Turning a bench run's measurements into its results: timings, quality, ratios against the reference."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..folder.artifacts import confined, read_manifest
from ..errors import UserError
from ..folder.paths import shown_path
from . import memory
from .runners import Generation
from .variants import VariantSpec, folder_bytes, model_bytes

# The reference is diffusers' PyTorch fp32 pipeline when it ran (the golden sample), else our ORT fp32 host loop.
SPEED_REFERENCES = ("torch-fp32", "ort-fp32")
FIDELITY_REFERENCES = ("torch-fp32", "ort-fp32")


@dataclass
class VariantState:
    """One variant through the run: its runner, timings, images, memory, or why it did not run."""

    spec: VariantSpec
    runner: object = None
    load: dict = field(default_factory=dict)
    first_call_s: float | None = None
    gens: list[Generation] = field(default_factory=list)  # timed repeats
    images: list[np.ndarray] = field(default_factory=list)  # quality pass, per batch
    step_latents: list[list[np.ndarray]] = field(default_factory=list)  # per batch: per step
    final_latents: list[np.ndarray] = field(default_factory=list)
    timing_images: np.ndarray | None = None
    timing_final: np.ndarray | None = None
    memory: dict = field(default_factory=dict)
    error: str | None = None
    rounds: list[dict] = field(default_factory=list)  # --isolate: every round's record
    isolated: dict | None = None  # --isolate: medians over the rounds (isolate.summarize)

    @property
    def ok(self) -> bool:
        return self.spec.skip is None and self.error is None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def image_sets(states: list[VariantState], results: dict) -> dict:
    """Images for the grid: quality-pass images when there was a quality pass, else the timed prompt's."""
    sets = {}
    for st in states:
        if not st.ok:
            continue
        if st.images:
            sets[st.spec.name] = np.concatenate(st.images)
        elif st.timing_images is not None:
            sets[st.spec.name] = st.timing_images
    return {"images": sets, "reference": results.get("fidelity_reference"), "captions": results.get("captions")}


def _variant_bytes(spec: VariantSpec, load: dict) -> int | None:
    try:
        if spec.kind == "ort":
            manifest = read_manifest(spec.folder)
            total = model_bytes(spec.folder, manifest)
            if spec.loop != "host":
                graph = manifest.components[f"sampler_{spec.loop}"]
                total += folder_bytes(confined(spec.folder, graph.path, "sampling graph").parent)
            return total
        if spec.kind == "torch":
            from ..families import get_family, names

            backbones = sorted({get_family(n).backbone for n in names()})  # the diffusers folder has one of them
            return sum(folder_bytes(Path(spec.folder) / c) for c in ("text_encoder", *backbones, "vae"))
        if spec.peer == "optimum":
            manifest = read_manifest(spec.folder)
            extra = manifest.component("vae_encoder")  # optimum loads the encoder too
            enc = folder_bytes(confined(spec.folder, extra.path, "vae_encoder").parent) if extra else 0
            return model_bytes(spec.folder, manifest) + enc
        if spec.peer in ("openvino", "sdcpp"):  # the converted model it runs (IR / GGUF)
            return load.get("ir_bytes")
    except (OSError, KeyError, UserError):
        return None
    return None


def _timing(gens: list[Generation], steps: int) -> dict:
    if not gens:
        return {}
    e2e = [g.total_s for g in gens]
    te = [g.text_encoder_s for g in gens]
    vae = [g.vae_s for g in gens]
    sampling = [g.sampling_s for g in gens]
    measured = all(g.step_s for g in gens)
    if measured:
        per_step = _median([s for g in gens for s in g.step_s])
        source = "median of every step's time (backbone call + sampler update)"
    else:
        per_step = _median([x / steps for x in sampling])
        source = "derived: sampling time / steps (the loop runs inside one graph)"
    return {
        "repeats": len(e2e),
        "e2e_s": e2e,
        "e2e_median_s": _median(e2e),
        "e2e_p90_s": _pct(e2e, 90),
        "e2e_min_s": min(e2e),
        "e2e_cpu_median_s": _median([g.cpu_s for g in gens]) if all(g.cpu_s is not None for g in gens) else None,
        "text_encoder_median_s": _median(te),
        "sampling_median_s": _median(sampling),
        "backbone_step_median_s": per_step,
        "backbone_step_cpu_median_s": _median([s for g in gens for s in g.step_cpu_s or []]) if measured else None,
        "backbone_step_source": source,
        "vae_median_s": _median(vae),
        "other_median_s": _median([g.total_s - g.text_encoder_s - g.sampling_s - g.vae_s for g in gens]),
    }


def _quality(st: VariantState, ref: VariantState | None, scenes, judge, prompts: int) -> dict:
    from ..evaluate.metrics import psnr, relative_l2, ssim

    q: dict = {}
    if not st.images:
        return q
    imgs = np.concatenate(st.images)
    if ref is not None and ref.images:
        rimgs = np.concatenate(ref.images)
        if rimgs.shape == imgs.shape:
            q["psnr_db"] = psnr(imgs, rimgs)
            q["psnr_per_image_db"] = [psnr(a, b) for a, b in zip(imgs, rimgs)]
            if min(imgs.shape[1:3]) >= 11:
                q["ssim"] = float(np.mean([ssim(a, b) for a, b in zip(imgs, rimgs)]))
        if st.final_latents and ref.final_latents:
            a, b = np.concatenate(st.final_latents), np.concatenate(ref.final_latents)
            if a.shape == b.shape:
                q["final_latent_rel_l2"] = relative_l2(a, b)
        if st.step_latents and ref.step_latents and st is not ref:
            n = min(len(st.step_latents[0]), len(ref.step_latents[0]))
            curve = []
            for i in range(n):
                a = np.concatenate([b[i] for b in st.step_latents])
                r = np.concatenate([b[i] for b in ref.step_latents])
                curve.append(relative_l2(a, r))
            q["error_curve"] = curve
    if judge is not None:
        from ..evaluate.run import evaluate_images

        ev = evaluate_images(imgs, scenes[:len(imgs)], judge)
        q["attribute_accuracy"] = ev["attribute_accuracy"]
        q["strict_accuracy"] = ev["strict_accuracy"]
        q["frechet_distance"] = ev["frechet_distance"] if len(imgs) >= 2 else None
        q["judge_count"] = ev["count"]
    return q


def _like_with_like(rows: list[dict], notes: list[str]) -> None:
    """A note when the rows compared (all but *-dpmpp) ran different numbers of backbone calls."""
    seen = {r["name"]: r.get("backbone_calls") for r in rows
            if r["status"] == "ok" and not r["name"].endswith("-dpmpp") and r.get("backbone_calls") is not None}
    if len({str(v) for v in seen.values()}) > 1:
        notes.append("NOT like with like: the rows made different numbers of backbone calls per image ("
                     + ", ".join(f"{n} {v}" for n, v in seen.items()) + "); compare their step times, not end to end.")


RATIO_KEYS = {"e2e_wall": ("e2e_median_s",), "e2e_cpu": ("e2e_cpu_median_s",), "step_wall": ("backbone_step_median_s",),
              "step_cpu": ("backbone_step_cpu_median_s",)}


def _ratios(rows: list[dict], ref: dict) -> None:
    """Each row's `vs_reference`: its median over the reference's (times and peak RSS; below 1 = faster/smaller)."""
    for r in rows:
        t, base = r.get("timing") or {}, ref.get("timing") or {}
        out = {}
        for name, (key,) in RATIO_KEYS.items():
            if t.get(key) and base.get(key):
                out[name] = t[key] / base[key]
        if r.get("peak_rss_bytes") and ref.get("peak_rss_bytes"):
            out["peak_rss"] = r["peak_rss_bytes"] / ref["peak_rss_bytes"]
        if out:
            r["vs_reference"] = out


def assemble(opts, model: Path, manifest: dict, source: Path | None, states: list[VariantState], scenes,
              judge, notes: list[str], height: int, width: int, machine: dict) -> dict:
    by = {st.spec.name: st for st in states}
    ran = {n for n, st in by.items() if st.ok and st.gens}
    speed_ref = next((n for n in SPEED_REFERENCES if n in ran), None)
    fid_ref = next((n for n in FIDELITY_REFERENCES if n in by and by[n].ok and by[n].images), None)
    rows = []
    for st in states:
        s = st.spec
        row = {
            "name": s.name, "label": s.label, "kind": s.kind, "precision": s.precision, "sampler": s.sampler,
            "steps": s.steps, "loop": s.loop, "folder": shown_path(s.folder),
            "status": "ok" if st.ok and st.gens else ("failed" if st.error else "skipped"),
            "reason": st.spec.skip or st.error,
            "notes": s.notes,
        }
        if st.spec.skip is None and st.load:
            row["size_bytes"] = _variant_bytes(s, st.load)
            row["load"] = {k: shown_path(v) if k.endswith(("_folder", "_path")) and v else v
                           for k, v in st.load.items() if k not in ("event",)}
            row["load_s"] = st.load.get("load_s")
            row["first_call_s"] = st.first_call_s
            row["timing"] = _timing(st.gens, s.steps)
            calls = {g.backbone_calls for g in st.gens} - {None}
            row["backbone_calls"] = calls.pop() if len(calls) == 1 else (sorted(calls) or None)
            row["memory"] = st.memory
            row["peak_rss_bytes"] = st.memory.get("peak_rss_bytes")
            if st.rounds:  # --isolate
                row["isolated"] = st.isolated
                row["rounds"] = st.rounds
            if row["status"] == "ok" and opts.arch is None:
                row["quality"] = _quality(st, by.get(fid_ref), scenes, judge, opts.prompts)
        rows.append(row)
    if speed_ref:
        base = next(r for r in rows if r["name"] == speed_ref)["timing"]
        for r in rows:
            t = r.get("timing") or {}
            if t.get("e2e_median_s"):
                r["speedup_vs_ref"] = base["e2e_median_s"] / t["e2e_median_s"]
                if t.get("backbone_step_median_s") and base.get("backbone_step_median_s"):
                    r["step_speedup_vs_ref"] = base["backbone_step_median_s"] / t["backbone_step_median_s"]
    if speed_ref:
        _ratios(rows, next(r for r in rows if r["name"] == speed_ref))
    _like_with_like(rows, notes)
    if opts.repeats < 5 and not opts.isolate:
        notes.append(f"only {opts.repeats} timed repeats (fewer than 5): treat the latency columns as rough.")
    return {
        "what": "onnxdiffusion bench",
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": shown_path(model),
        "source": shown_path(source),
        "arch": opts.arch,
        "settings": {
            "steps": opts.steps, "fast_steps": opts.fast_steps, "repeats": opts.repeats, "prompts": opts.prompts,
            "batch": opts.batch, "guidance": opts.guidance, "height": height, "width": width,
            "threads": opts.threads, "rss": opts.rss, "profile": opts.profile, "timed_job": "1 prompt, batch 1, seed 0",
            "isolate": opts.isolate, "memory": opts.memory, "quantize": list(opts.quantize),
            "variants_requested": list(opts.variants),
        },
        "speed_reference": speed_ref,
        "fidelity_reference": fid_ref,
        "captions": [sc.caption for sc in scenes[: max(opts.prompts, 1)]],
        "machine": machine,
        "notes": notes,
        "memory_method": memory.METHOD,
        "variants": rows,
    }
