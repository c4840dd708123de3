#!/usr/bin/env python
"""int8-static VAE decoder and text encoders on the trained embedded models: final-image PSNR vs fp32 (issue 16).

    python experiments/quantize-embedded/component_quant_eval.py --models models/shapes-sd-onnx models/shapes-mmdit-onnx \\
        --count 64 --work runs/component_quant --out bench/report_sd15/component_quant_trained.json

Per model: `quantize --recipe int8-static -O components=unet,vae_decoder,<text encoders>` (32 calib-split
prompts, the model's recommended sampler settings), then the held-out prompts (seed i for prompt i, the
model's recommended sampler, steps, guidance) with the fp32 folder and with each quantized component swapped
into the fp32 pipeline alone (the VAE decoder: the fp32 final latents decoded by the int8 decoder; a text
encoder: the whole sampling rerun on its conditioning), then all of them, then the whole quantized folder;
PSNR of the final images vs fp32 (mean and worst image). Also each component's latency (1 thread, median of
interleaved runs) and bytes. `components_keep_float` patterns: `--keep-float PATTERN` (repeatable; default the
recipe's, the VAE decoder's conv_out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from onnxdiffusion.folder.artifacts import component_path, read_manifest  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import latency  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402
from onnxdiffusion.runtime.memory import LazySession  # noqa: E402
from onnxdiffusion.runtime.loading import disabled as _disabled  # noqa: E402
from onnxdiffusion.runtime.session import make_session  # noqa: E402


def _swap(pipe: Pipeline, qfolder: Path, qmanifest: dict, names: list[str]) -> None:
    for name in names:
        session = make_session(component_path(qfolder, qmanifest, name), "cpu", 1,
                               disabled_optimizers=_disabled(qmanifest["components"][name]))
        if name == "vae_decoder":
            pipe.vae_decoder = session
        else:
            pipe.text_sessions[name] = LazySession(lambda s=session: s, release=False, session=session)


def _stats(ref: np.ndarray, got: np.ndarray) -> dict:
    vals = [psnr(a, b) for a, b in zip(ref, got)]
    finite = [v for v in vals if np.isfinite(v)]
    return {"mean_db": round(float(np.mean(finite)), 2) if finite else float("inf"),
            "worst_db": round(float(min(vals)), 2), "identical": len(vals) - len(finite), "images": len(vals)}


def evaluate(model: Path, work: Path, count: int, keep_float: list[str], log, reuse: bool = False) -> dict:
    manifest = read_manifest(model)
    rec = manifest.get("recommended") or {}
    texts = [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if n in manifest["components"]]
    names = ["vae_decoder", *texts]
    opts = {"components": ",".join(["unet", *names])}
    if keep_float:
        opts["components_keep_float"] = ",".join(keep_float)
    cal = CalibrationConfig(count=32, sampler=rec.get("sampler", "ddim"), steps=rec.get("steps", 20),
                            guidance=rec.get("guidance", 4.0))
    out = work / model.name
    work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    if reuse and (out / "quantize_report.json").is_file():  # the folder an earlier run of this script wrote
        report = json.loads((out / "quantize_report.json").read_text())
    else:
        report = quantize(model, out, QuantizeConfig(recipe=recipe_class("int8-static").with_options(opts), calibration=cal,
                                                     latency_runs=20), overwrite=True, log=log)
    log(f"{model.name}: quantized in {time.time() - t:.0f} s")
    qman = read_manifest(out)
    ev = EvaluateOptions(count=count, steps=rec.get("steps", 20), sampler=rec.get("sampler"), guidance=rec.get("guidance", 4.0),
                         batch=16)
    scenes = heldout_scenes(ev)
    latents = []
    ref_pipe = Pipeline.from_folder(model, threads=1)
    ref = generate_set(ref_pipe, scenes, ev, progress=False,
                       step_callback=lambda start, e: latents.append(e.latents) if hasattr(e, "images") else None)
    rows = {}
    vae = Pipeline.from_folder(model, threads=1)
    _swap(vae, out, qman, ["vae_decoder"])
    rows["vae_decoder"] = _stats(ref, np.concatenate([vae.decode(x) for x in latents]))
    for name in texts:
        p = Pipeline.from_folder(model, threads=1)
        _swap(p, out, qman, [name])
        rows[name] = _stats(ref, generate_set(p, scenes, ev, progress=False))
    if len(texts) > 1:  # the decoder with one int8 text encoder
        for name in texts:
            p = Pipeline.from_folder(model, threads=1)
            _swap(p, out, qman, ["vae_decoder", name])
            rows[f"vae_decoder+{name}"] = _stats(ref, generate_set(p, scenes, ev, progress=False))
    p = Pipeline.from_folder(model, threads=1)
    _swap(p, out, qman, names)
    rows["vae_decoder+text_encoders"] = _stats(ref, generate_set(p, scenes, ev, progress=False))
    rows["whole int8-static folder (backbone too)"] = _stats(ref, generate_set(Pipeline.from_folder(out, threads=1), scenes, ev,
                                                                               progress=False))
    for k, v in rows.items():
        log(f"{model.name} {k}: {v}")
    speed = {}
    for name in names:
        feed = component_feed(name, manifest)
        t = latency({"fp32": component_path(model, manifest, name), "int8": component_path(out, qman, name)}, feed, 1, 30)
        speed[name] = {"fp32_ms": round(t["fp32"]["median_ms"], 3), "int8_ms": round(t["int8"]["median_ms"], 3),
                       "speedup": round(t["fp32"]["median_ms"] / t["int8"]["median_ms"], 2),
                       "fp32_bytes": manifest["components"][name]["bytes"], "int8_bytes": qman["components"][name]["bytes"]}
    return {"recipe": report["recipe"], "calibration": cal.to_dict(), "settings": {"count": count, **ev.__dict__},
            "psnr_vs_fp32": rows, "latency_1thread": speed,
            "components": report["details"].get("components"), "backbone_probe_psnr_db": report["quality"].get("probe_psnr_db")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", type=Path, default=[Path("models/shapes-sd-onnx"), Path("models/shapes-mmdit-onnx")])
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--keep-float", action="append", default=[])
    ap.add_argument("--work", type=Path, default=Path("runs/component_quant"))
    ap.add_argument("--reuse", action="store_true", help="use the quantized folder a previous run left in --work")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = {"keep_float": args.keep_float, "models": {}}
    for model in args.models:
        results["models"][str(model)] = evaluate(model, args.work, args.count, args.keep_float, log, args.reuse)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
