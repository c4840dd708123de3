"""Every quantization recipe on one or more exported model folders, side by side (issues 5 and 12).

    .venv/bin/python experiments/quantize-embedded/quantize_eval.py --models models/shapes-sd-onnx models/shapes-mmdit-onnx
    .venv/bin/python experiments/quantize-embedded/quantize_eval.py --suite issue5 --models models/shapes-sd-onnx --out experiments/quantize-embedded/quantize.json

For every model and recipe: quantize into --work/<model>/<label>, generate the held-out prompts
(seed i for prompt i) with the fp32 and the quantized folder at the model's recommended sampler,
steps and guidance (its manifest's `recommended`; `MODEL@sampler,steps,guidance` overrides), and
report image PSNR vs fp32 (mean and worst image), the judge's strict and attribute accuracy,
backbone file size ratio, backbone latency (median of interleaved runs, one thread, at 1/4/16
images = 2/8/32 guided rows), float nodes, and the Loop form's agreement with the host loop.
Calibration: 32 calib-split prompts at the same sampler settings. A recipe slower than fp32 at any
measured batch says so in its verdict. Writes OUT (.json and a Markdown table .md) and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantize_tables import _summaries, markdown, side_by_side  # noqa: E402

from onnxdiffusion.folder.artifacts import read_manifest, sha256_file  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_images, generate_set, heldout_scenes  # noqa: E402
from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.loopgraph.compile import compile_loop  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, QuantizeConfig, quantize, recipe_class  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402
from onnxdiffusion.quantize.runner import latency  # noqa: E402
from onnxdiffusion.quantize.schedule import ScheduleConfig  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

SMOOTH = "0.5"  # SmoothQuant's default migration strength
# w4a8-rot gptq-clip 8bit-sensitive's 43 linears given 8-bit weights (-O target_ratio=3.0), in its ranking's order
RANKED_8BIT = tuple("/model/" + n for n in (
    "proj_out/MatMul", "transformer_blocks.3/attn/to_out.0/MatMul", "transformer_blocks.3/attn/to_v/MatMul",
    "transformer_blocks.5/attn/to_v/MatMul", "transformer_blocks.5/ff/net.0/proj/MatMul", "transformer_blocks.4/ff/net.0/proj/MatMul",
    "transformer_blocks.5/attn/to_out.0/MatMul", "transformer_blocks.4/ff/net.2/MatMul", "transformer_blocks.3/ff/net.0/proj/MatMul",
    "time_text_embed/text_embedder/linear_2/Gemm", "transformer_blocks.3/attn/to_k/MatMul", "transformer_blocks.3/attn/to_q/MatMul",
    "norm_out/linear/Gemm", "transformer_blocks.5/ff/net.2/MatMul", "transformer_blocks.3/ff/net.2/MatMul",
    "transformer_blocks.5/attn/to_k/MatMul", "transformer_blocks.2/attn/to_out.0/MatMul", "transformer_blocks.2/attn/to_k/MatMul",
    "transformer_blocks.2/attn/to_v/MatMul", "transformer_blocks.4/attn/to_out.0/MatMul", "time_text_embed/timestep_embedder/linear_2/Gemm",
    "transformer_blocks.2/attn/to_q/MatMul", "transformer_blocks.0/attn/to_k/MatMul", "transformer_blocks.2/ff/net.0/proj/MatMul",
    "transformer_blocks.0/ff/net.0/proj/MatMul", "transformer_blocks.5/attn/to_q/MatMul", "transformer_blocks.4/attn/to_v/MatMul",
    "transformer_blocks.0/attn/to_out.0/MatMul", "transformer_blocks.1/ff/net.0/proj/MatMul", "transformer_blocks.0/attn/to_v/MatMul",
    "transformer_blocks.3/attn/add_v_proj/MatMul", "transformer_blocks.1/ff/net.2/MatMul", "transformer_blocks.2/ff/net.2/MatMul",
    "transformer_blocks.0/attn/to_q/MatMul", "transformer_blocks.4/attn/to_q/MatMul", "transformer_blocks.0/norm1/linear/Gemm",
    "transformer_blocks.0/ff/net.2/MatMul", "transformer_blocks.4/attn/to_k/MatMul", "transformer_blocks.1/attn/to_out.0/MatMul",
    "transformer_blocks.1/attn/to_v/MatMul", "transformer_blocks.4/attn/add_v_proj/MatMul", "transformer_blocks.5/attn/add_v_proj/MatMul",
    "transformer_blocks.1/attn/to_q/MatMul",
))
# (label, recipe name, options, correct: False or the correction method)
SUITES = {
    "issue12": [
        ("fp16", "fp16", {}, False),
        ("int8-dynamic", "int8-dynamic", {}, False),
        ("int8-static", "int8-static", {}, False),  # op groups chosen by measured sensitivity (and speed)
        ("int8-static+smooth", "int8-static", {"smooth_alpha": SMOOTH}, False),
        # alpha picked on the calibration prompts' probe images (MMDiT: 0.5 45.2 dB, 0.65 49.1 dB, 0.8 47.6 dB)
        ("int8-static+smooth(a=0.65)", "int8-static", {"smooth_alpha": "0.65"}, False),
        # the linears whose quantization alone adds > 10% of all linears' error stay float (MMDiT: the
        # patch embedding and the output projection, 0.58 and 0.16 of it, 2k of 908k weights)
        ("int8-static keep-sensitive", "int8-static", {"keep_sensitive": "0.1"}, False),
        ("int8-static+smooth keep-sensitive", "int8-static", {"smooth_alpha": SMOOTH, "keep_sensitive": "0.1"}, False),
        # + empirical bias correction (each linear's mean per-channel error, measured alone on the calibration
        # feeds, folded into its bias); chosen over keep-sensitive+bc on the 32-pair proxy (int8_worst_images.md)
        ("int8-static+smooth keep-sensitive+bc", "int8-static",
         {"smooth_alpha": SMOOTH, "keep_sensitive": "0.1", "bias_correction": "1"}, False),
        # + the per-step precision schedule (issue 12's sampler-side remedy): the fp32 backbone at the fewest
        # steps that close 95% of the int8 image MSE on the calibration prompts (chosen there, not on held-out pairs)
        ("int8-static+smooth keep-sensitive+schedule", "int8-static",
         {"smooth_alpha": SMOOTH, "keep_sensitive": "0.1", "precision_schedule": "target=0.95"}, False),
        ("int8-static attn-int8", "int8-static", {"attention": "int8"}, False),
        ("int8-static attn-int8+smooth", "int8-static", {"attention": "int8", "smooth_alpha": SMOOTH}, False),
        ("int8-timestep", "int8-timestep", {"groups": "4"}, False),
        ("mixed", "mixed", {"target_psnr": "36"}, False),
        ("int4-weights", "int4-weights", {}, False),
        ("int4-weights 8bit-sensitive", "int4-weights", {"target_ratio": "3.5"}, False),
        # asymmetric 64-blocks: all-4-bit 4.06x (vs 3.92x symmetric 32-blocks) at the same quality on the MMDiT,
        # so the 3.5x floor leaves more layers 8-bit (experiments/quantize-embedded/int4_algorithms.md: 36.9 vs 33.8 dB, 32 pairs)
        ("int4-weights 8bit-sensitive asym-b64", "int4-weights", {"target_ratio": "3.5", "block_size": "64", "symmetric": "false"}, False),
        ("int4+int8", "int4-weights", {"others": "int8", "accuracy_level": "4"}, False),
    ],
    # issue 44: group Hadamard rotation (docs/recipes/rotation.md). "every linear": every weight linear int8
    # (modulation too), no keep-float list, no keep_sensitive, no precision schedule
    "issue44": [
        ("w8a8 every-linear", "int8-static", {"modulation": "int8"}, False),
        ("w8a8-rot every-linear", "int8-static", {"modulation": "int8", "rotate": "hadamard"}, False),
        # the patch-embedding conv's output left float like the linears' (MatMulIntegerToFloat): not re-quantized
        ("w8a8-rot every-linear conv-float-out", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "float_outputs": "Conv,MatMul,Gemm"}, False),
        # the patch-embedding conv (a conv, not a linear: its 8-bit input is the latent itself) kept float
        ("w8a8-rot every-linear conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        # and the final projection (a linear: no longer "every linear") float too
        ("w8a8-rot conv-float proj_out-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "keep_float": "/model/pos_embed/proj/Conv,/model/proj_out/MatMul"}, False),
        # the same with timestep-grouped activation scales (int8-timestep: one graph, weights shared)
        ("w8a8-rot-timestep every-linear", "int8-timestep",
         {"groups": "4", "modulation": "int8", "rotate": "hadamard", "float_outputs": "Conv,MatMul,Gemm"}, False),
        ("w8a8-rot-timestep every-linear conv-float", "int8-timestep",
         {"groups": "4", "modulation": "int8", "rotate": "hadamard", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w8a8-rot-timestep8 every-linear conv-float", "int8-timestep",
         {"groups": "8", "modulation": "int8", "rotate": "hadamard", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        # per-token dynamic int8 activations (int8-static -O activations=dynamic-token): no calibrated linear scale
        ("w8a8-rot dynamic-token conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w8a8-rot dynamic-token-asym conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token-asym", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w8a8-rot dynamic-token", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token", "float_outputs": "Conv,MatMul,Gemm"}, False),
        ("w8a8 dynamic-token conv-float", "int8-static",
         {"modulation": "int8", "activations": "dynamic-token", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        # the same linears' int8 weights rounded by GPTQ (quantize/gptq.py; Hessians of the rotated float inputs
        # at every calibration step: gptq_steps 20, the default; gptq8: 8 of the 20)
        ("w8a8-rot dynamic-token-asym gptq conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token-asym", "weights": "gptq",
          "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w8a8-rot dynamic-token-asym gptq8 conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token-asym", "weights": "gptq",
          "gptq_steps": "8", "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w8a8-rot dynamic-token gptq conv-float", "int8-static",
         {"modulation": "int8", "rotate": "hadamard", "activations": "dynamic-token", "weights": "gptq",
          "keep_float": "/model/pos_embed/proj/Conv"}, False),
        ("w4a8", "int4-weights", {"accuracy_level": "4"}, False),
        ("w4a8-rot", "w4a8", {}, False),
        ("w4a8-rot b16", "w4a8", {"block_size": "16"}, False),
        ("w4a8-rot b64", "w4a8", {"block_size": "64"}, False),
        ("w4a8-rot gptq", "w4a8", {"algorithm": "gptq"}, False),
        ("w4a8-rot gptq b64", "w4a8", {"algorithm": "gptq", "block_size": "64"}, False),
        ("w4a8-rot gptq 8bit-sensitive", "w4a8", {"algorithm": "gptq", "target_ratio": "3.5"}, False),
        # GPTQ written here (quantize/gptq.py): Hessians of the rotated inputs, per-block clip search, zero points
        ("w4a8-rot gptq-clip", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false"}, False),
        ("w4a8-rot gptq-clip b16", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "block_size": "16"}, False),
        # the linears whose 4-bit weights add the most output error per byte saved at 8 bits, the backbone >= 3x smaller than fp32
        ("w4a8-rot gptq-clip 8bit-sensitive", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "target_ratio": "3.0"}, False),
        # the linears named 8-bit (`weights_8bit`), the rest gptq-clip 4-bit: the context embedder and the final
        # projection (1.3% of the linears' weights: +2.0 dB backbone SQNR on the probe, w4_weight_probe.py groups)
        ("w4a8-rot gptq-clip b16 embed-out-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "block_size": "16",
                                                            "weights_8bit": "/model/context_embedder/MatMul,/model/proj_out/MatMul"}, False),
        # and every attention projection 8-bit (23% of the linears' weights, 65% of their bytes still 4-bit; probe
        # 27.6 dB at 32-blocks against 23.6 all-4-bit and 25.6 with the two above alone)
        ("w4a8-rot gptq-clip b16 attn-embed-out-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "block_size": "16",
                                                                 "weights_8bit": "*/attn/*,/model/context_embedder/MatMul,/model/proj_out/MatMul"}, False),
        # or the MLPs' up projections instead (21% of the weights, 67% of the bytes 4-bit; probe 28.1 dB at 32-blocks)
        ("w4a8-rot gptq-clip b16 mlp-up-embed-out-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "block_size": "16",
                                                                   "weights_8bit": "*/net.0/proj/MatMul,/model/context_embedder/MatMul,/model/proj_out/MatMul"}, False),
        # the first K of that row's 43 picks (RANKED_8BIT, its ranking's order) named by weights_8bit: 30 -> 61% of the
        # linears' bytes 4-bit (26% of the weights 8-bit), 34 -> 55%, 36 -> 52%
        ("w4a8-rot gptq-clip top30-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "weights_8bit": ",".join(RANKED_8BIT[:30])}, False),
        ("w4a8-rot gptq-clip top34-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "weights_8bit": ",".join(RANKED_8BIT[:34])}, False),
        ("w4a8-rot gptq-clip top36-8bit", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false", "weights_8bit": ",".join(RANKED_8BIT[:36])}, False),
        # pair 101 flips under any 4-bit weights in the first 4 of the 20 steps (experiments/rotation/w4_step_probe.py):
        # the same with a precision schedule, its 4 most sensitive steps run by an fp16 copy of the backbone
        ("w4a8-rot gptq-clip top36-8bit schedule4-fp16", "w4a8", {"algorithm": "gptq-clip", "symmetric": "false",
                                                                  "weights_8bit": ",".join(RANKED_8BIT[:36]),
                                                                  "precision_schedule": "steps=4,precision=fp16"}, False),
        # the UNet's linears (and convs, as int8-static quantizes them) rotated: issue 44's "UNet too"
        ("w8a8", "int8-static", {}, False),
        ("w8a8-rot", "int8-static", {"rotate": "hadamard"}, False),
    ],
    "issue5": [
        ("int8-static", "int8-static", {}, False),
        ("int8-naive", "int8-naive", {}, False),
        ("int8-timestep", "int8-timestep", {"groups": "4"}, False),
        ("int8-static+correct", "int8-static", {}, "trajectory"),
        ("int8-static+correct-output", "int8-static", {}, "output"),
        ("mixed", "mixed", {"target_psnr": "36"}, False),
        ("mixed-45dB", "mixed", {"target_psnr": "45"}, False),
        ("int4-weights", "int4-weights", {}, False),
        ("int4-weights+int8", "int4-weights", {"others": "int8"}, False),
        ("int8-dynamic", "int8-dynamic", {}, False),
        ("fp16", "fp16", {}, False),
        ("int8-static-entropy", "int8-static", {"calibrator": "entropy"}, False),
        ("int8-static-mean", "int8-static", {"aggregation": "mean"}, False),
    ],
}
LATENCY_BATCHES = (1, 4, 16)  # images; the backbone sees twice as many rows (uncond + cond)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def generate(folder: Path, scenes, options: EvaluateOptions, loop: str | None = None) -> np.ndarray:
    """loop None: the evaluation path (batches of options.batch); else one batch through that loop form."""
    pipe = Pipeline.from_folder(folder, threads=1)
    if loop is None:
        return generate_set(pipe, scenes, options, progress=False)
    from onnxdiffusion.evaluate.run import item_latents

    shape = pipe.latent_shape_for(1)[1:]
    lat = item_latents(shape, list(range(len(scenes))))
    return pipe([sc.caption for sc in scenes], steps=options.steps, sampler=options.sampler, guidance=options.guidance,
                batch=len(scenes), latents=lat, loop=loop).images


def model_settings(spec: str) -> tuple[Path, dict]:
    """`FOLDER` (the manifest's recommended settings) or `FOLDER@sampler,steps,guidance`."""
    path, _, override = spec.partition("@")
    folder = Path(path)
    manifest = json.loads((folder / "manifest.json").read_text())
    rec = dict(manifest.get("recommended") or {})
    settings = {"sampler": rec.get("sampler", "ddim"), "steps": int(rec.get("steps", 20)), "guidance": float(rec.get("guidance", 4.0))}
    if override:
        sampler, steps, guidance = override.split(",")
        settings = {"sampler": sampler, "steps": int(steps), "guidance": float(guidance)}
    return folder, settings


def schedule_backbone(folder: Path, report: dict) -> tuple[Path, int] | None:
    """A scheduled folder's high-precision backbone file and how many of the steps run it."""
    chosen = (report.get("precision_schedule") or {}).get("chosen")
    if not chosen:
        return None
    manifest = json.loads((folder / "manifest.json").read_text())
    ps = next(c["precision_schedule"] for c in manifest["components"].values() if c.get("precision_schedule"))
    return folder / manifest["components"][ps["component"]]["path"], len(chosen["high_steps"])


def slower_than_fp32(sweep: dict) -> list[str]:
    return [f"{int(k[4:]) // 2} img {v['ratio']:.2f}x" for k, v in sweep.items() if v["ratio"] > 1.0]


def fp32_reference(folder: Path, scenes, options: EvaluateOptions, settings: dict, work: Path, judge):
    """The fp32 images and their judge scores, cached in `work` by the backbone's hash and the settings
    (a later --only run of the same suite skips the ~8 min regeneration)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    backbone = folder / manifest["components"][get_family(manifest.get("family")).backbone]["path"]
    key = f"{sha256_file(backbone)[:16]}_{len(scenes)}_{settings['sampler']}_{settings['steps']}_{settings['guidance']}"
    cache = work / f"fp32_reference_{key}.npz"
    if cache.exists():
        with np.load(cache, allow_pickle=False) as z:
            return z["images"], json.loads(str(z["eval"]))
    ref = generate(folder, scenes, options)
    ev = evaluate_images(ref, scenes, judge)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, images=ref, eval=json.dumps({k: ev[k] for k in ("strict_accuracy", "attribute_accuracy", "frechet_distance")}))
    tmp.replace(cache)
    return ref, ev


def run_model(folder: Path, settings: dict, runs: list, args, judge) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    backbone = get_family(manifest.get("family")).backbone
    options = EvaluateOptions(count=args.count, steps=settings["steps"], sampler=settings["sampler"],
                              guidance=settings["guidance"], batch=32)
    scenes = heldout_scenes(options)
    calib = CalibrationConfig(count=args.calib_count, steps=settings["steps"], sampler=settings["sampler"],
                              guidance=settings["guidance"])
    work = args.work / folder.name
    work.mkdir(parents=True, exist_ok=True)
    log(f"{folder.name}: fp32 reference, {len(scenes)} held-out prompts")
    t0 = time.perf_counter()
    ref, fp32_eval = fp32_reference(folder, scenes, options, settings, work, judge)
    result = {
        "model": os.path.relpath(folder.resolve(), ROOT) if folder.resolve().is_relative_to(ROOT) else folder.name,
        "family": manifest.get("family", "sd"),
        "backbone": backbone,
        "stand_in": False,
        "settings": {"count": len(scenes), "split": "heldout", **settings, "calibration": calib.to_dict(), "threads": 1,
                     "latency_runs": args.latency_runs, "machine": platform.processor() or platform.machine(),
                     "cpus": os.cpu_count(), "note": "latency on a shared 2-core machine: interleaved medians, ratios"},
        "fp32": {k: fp32_eval[k] for k in ("strict_accuracy", "attribute_accuracy", "frechet_distance")}
        | {"generate_seconds": round(time.perf_counter() - t0, 1)},
        "recipes": {},
    }
    fp32_backbone = folder / manifest["components"][backbone]["path"]
    for label, name, opts, correct in runs:
        out = work / label.replace("+", "_").replace(" ", "_")
        log(f"{folder.name} {label}: quantize")
        t0 = time.perf_counter()
        opts = dict(opts)
        schedule = ScheduleConfig.parse(opts.pop("precision_schedule")) if "precision_schedule" in opts else None
        cfg = QuantizeConfig(recipe=recipe_class(name).with_options(opts), calibration=calib, correct=bool(correct),
                             correct_method=correct or "trajectory", threads=1, latency_runs=args.latency_runs,
                             schedule=schedule)
        report = quantize(folder, out, cfg, overwrite=True, log=log)
        q_seconds = time.perf_counter() - t0
        images = generate(out, scenes, options)
        ev = evaluate_images(images, scenes, judge)
        per_image = [psnr(a, b) for a, b in zip(images, ref)]
        per_image_mse = ((images.astype(np.float64) - ref.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
        mse = float(per_image_mse.mean())
        img_mse = np.sort(per_image_mse)[::-1]
        worst = max(1, len(img_mse) // 10)
        compile_loop(out, out, form="loop")
        n = min(args.loop_check, len(scenes))
        loop_psnr = psnr(generate(out, scenes[:n], options, loop="loop"), generate(out, scenes[:n], options, loop="host"))
        lat = {}
        new_backbone = out / manifest["components"][backbone]["path"]
        high = schedule_backbone(out, report)
        for b in LATENCY_BATCHES:
            feed = component_feed(backbone, read_manifest(folder), batch=b)  # the typed manifest (folder.artifacts)
            runs_b = max(15, args.latency_runs // b)
            files = {"fp32": fp32_backbone, "new": new_backbone} | ({"high": high[0]} if high else {})
            t = latency(files, feed, 1, runs_b)
            new_ms = t["new"]["median_ms"]
            if high:  # per step of a whole image: the high-precision backbone at its steps, the quantized one elsewhere
                k, n = high[1], settings["steps"]
                new_ms = (k * t["high"]["median_ms"] + (n - k) * new_ms) / n
            lat[f"rows{2 * b}"] = {"fp32_ms": round(t["fp32"]["median_ms"], 3), "new_ms": round(new_ms, 3),
                                   "ratio": round(new_ms / t["fp32"]["median_ms"], 3), "runs": runs_b}
        slower = slower_than_fp32(lat)
        verdict = report["verdict"] + (f"; SLOWER than fp32 at {', '.join(slower)}" if slower else "")
        finite = [p for p in per_image if math.isfinite(p)]
        entry = {
            "recipe": report["recipe"],
            "correct": correct,
            "psnr_db_mean": float(np.mean(finite)) if finite else math.inf,
            "psnr_db_min": float(np.min(per_image)),
            "psnr_db_of_mean_mse": 10 * math.log10(255.0**2 / mse) if mse > 0 else math.inf,
            "image_mse": mse,
            "image_mse_per_image": [round(float(v), 6) for v in per_image_mse],
            "mse_share_worst_10pct_images": float(img_mse[:worst].sum() / img_mse.sum()) if img_mse.sum() > 0 else None,
            "strict_accuracy": ev["strict_accuracy"],
            "attribute_accuracy": ev["attribute_accuracy"],
            "frechet_distance": ev["frechet_distance"],
            "unet_bytes": report["sizes"].get("unet", {}).get("bytes"),
            "unet_size_ratio": report["sizes"].get("unet", {}).get("ratio"),
            "latency_report": report["latency"].get(backbone),
            "latency_sweep": lat,
            "slower_than_fp32": slower,
            "verdict": verdict,
            "float_node_count": report["float_node_count"],
            "float_nodes": report["float_nodes"],
            "quantized_node_count": report["quantized_node_count"],
            "fused_ops": report["fused_ops"],
            "quality_on_calibration": report["quality"],
            "loop_vs_host_psnr_db": loop_psnr,
            "quantize_seconds": round(q_seconds, 1),
            "unet_sha256": sha256_file(new_backbone),
            "details": {k: v for k, v in report["details"].items() if k != "ranking"} | (
                {"ranking_top": report["details"]["ranking"][:30]} if "ranking" in report["details"] else {}),
        }
        if high:  # the folder ships both backbones: its size counts both
            high_bytes = sum(f.stat().st_size for f in high[0].parent.iterdir() if f.is_file())
            q_bytes, ratio = entry["unet_bytes"], entry["unet_size_ratio"]
            entry["schedule"] = {"high_steps": report["precision_schedule"]["chosen"]["high_steps"], "high_bytes": high_bytes,
                                 "quantized_bytes": q_bytes, "quantized_size_ratio": ratio, "spec": cfg.schedule.to_dict()}
            entry["unet_bytes"] = q_bytes + high_bytes
            entry["unet_size_ratio"] = round(ratio * q_bytes / entry["unet_bytes"], 3) if ratio and q_bytes else None
        result["recipes"][label] = entry
        log(f"{folder.name} {label}: PSNR {entry['psnr_db_mean']:.2f} dB (worst {entry['psnr_db_min']:.2f}), strict "
            f"{entry['strict_accuracy']:.3f}, size {entry['unet_size_ratio']}x, latency {lat['rows2']['ratio']}x, "
            f"loop/host {loop_psnr:.1f} dB")
        args.partial(folder.name, result)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[str(ROOT / "models" / "shapes-sd-onnx")],
                    help="model folders, each FOLDER or FOLDER@sampler,steps,guidance")
    ap.add_argument("--suite", choices=list(SUITES), default="issue12")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "quantize")
    ap.add_argument("--count", type=int, default=128, help="held-out prompt-seed pairs (seeds 0..count-1)")
    ap.add_argument("--calib-count", type=int, default=32)
    ap.add_argument("--loop-check", type=int, default=8, help="prompts generated again through the Loop form")
    ap.add_argument("--latency-runs", type=int, default=40)
    ap.add_argument("--only", nargs="*", help="labels of the suite to run")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/quantize_<suite>.json")
    ap.add_argument("--merge", action="store_true", help="update OUT's recipes rather than replace the file")
    ap.add_argument("--combine", nargs="+", type=Path, help="only join these result files (one model each) into OUT")
    args = ap.parse_args(argv)
    out = args.out or Path(__file__).resolve().parent / f"quantize_{args.suite}.json"
    if args.combine:
        return combine(args.combine, out, args.suite)
    runs = [r for r in SUITES[args.suite] if not args.only or r[0] in args.only]
    judge = Judge.from_file(threads=1)
    combined: dict = {"suite": args.suite, "order": [r[0] for r in SUITES[args.suite]], "models": {}}
    previous = json.loads(out.read_text())["models"] if args.merge and out.exists() else {}

    def partial(name, result):
        if name in previous:  # earlier recipes first, in the suite's order
            merged = {**previous[name]["recipes"], **result["recipes"]}
            order = [r[0] for r in SUITES[args.suite]]
            result = {**result, "recipes": dict(sorted(merged.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))}
        combined["models"][name] = result
        _write(out, combined)

    args.partial = partial
    for spec in args.models:
        folder, settings = model_settings(spec)
        result = run_model(folder, settings, runs, args, judge)
        if args.suite == "issue5":
            determinism(folder, settings, result, runs, args)
        partial(folder.name, result)
        _summaries(combined["models"][folder.name])
    for name, r in previous.items():
        combined["models"].setdefault(name, r)
    combined["acceptance_issue12"] = acceptance_issue12(combined["models"])
    _write(out, combined)
    text = side_by_side(combined) + "\n\n" + "\n\n".join(markdown(r) for r in combined["models"].values())
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


def combine(files: list[Path], out: Path, suite: str) -> int:
    combined: dict = {"suite": suite, "order": [r[0] for r in SUITES[suite]], "models": {}}
    source: dict = {}  # (model, label) -> the file its row came from
    earlier: dict = {}  # model -> the first file's own carried_over (where its rows came from before)
    for f in files:  # a later file's recipes replace an earlier one's of the same label
        for name, r in json.loads(f.read_text())["models"].items():
            if f == files[0] and r.get("carried_over"):
                earlier[name] = r["carried_over"]
            source.update({(name, label): f for label in r["recipes"]})
            if name in combined["models"]:
                r = {**combined["models"][name], **r, "recipes": {**combined["models"][name]["recipes"], **r["recipes"]}}
            combined["models"][name] = r
    if len(files) > 1:  # rows not measured again by the later files say where they come from
        for name, r in combined["models"].items():
            old = [label for label in r["recipes"] if source[(name, label)] == files[0]]
            newer = any(src != files[0] for (m, _), src in source.items() if m == name)
            if old and newer:
                before = earlier.get(name)
                src = files[0].name + (f" (rows {', '.join(x for x in before['rows'] if x in old)} there from {before['from']})"
                                       if before and any(x in old for x in before["rows"]) else "")
                r["carried_over"] = {"from": src, "rows": old}
            else:
                r.pop("carried_over", None)
    order = [r[0] for r in SUITES[suite]]
    for r in combined["models"].values():
        r["recipes"] = dict(sorted(r["recipes"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    for r in combined["models"].values():
        _summaries(r)
    combined["acceptance_issue12"] = acceptance_issue12(combined["models"])
    _write(out, combined)
    text = side_by_side(combined) + "\n\n" + "\n\n".join(markdown(r) for r in combined["models"].values())
    schedule = Path(__file__).resolve().parent / "precision_schedule.md"  # the schedule vs --correct, both models
    if schedule.exists():
        text += "\n\n" + schedule.read_text().rstrip("\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


def determinism(folder: Path, settings: dict, result: dict, runs: list, args) -> None:
    """Quantize the static and timestep recipes again and compare bytes."""
    calib = CalibrationConfig(count=args.calib_count, steps=settings["steps"], sampler=settings["sampler"],
                              guidance=settings["guidance"])
    backbone = result["backbone"]
    for label in ("int8-static", "int8-timestep"):
        if label not in result["recipes"]:
            continue
        name, opts = next((n, o) for lb, n, o, _ in runs if lb == label)
        again = args.work / folder.name / f"{label}-again"
        cfg = QuantizeConfig(recipe=recipe_class(name).with_options(opts), calibration=calib, threads=1, latency_runs=3)
        quantize(folder, again, cfg, overwrite=True)
        same = sha256_file(again / backbone / "model.onnx") == result["recipes"][label]["unet_sha256"]
        result.setdefault("determinism", {})[label] = same


def acceptance_issue12(models: dict) -> dict:
    """Issue 12's acceptance 3, on the transformer-family model(s) measured."""
    acc = {}
    for name, r in models.items():
        if r.get("family") == "sd" or not r["recipes"]:
            continue
        rec = r["recipes"]
        statics = {k: v for k, v in rec.items() if k.startswith("int8-static")}
        if statics:
            best = max(statics, key=lambda k: statics[k]["psnr_db_mean"])
            acc[f"{name}: 3_int8_static_best ({best}) mean >= 35 dB"] = statics[best]["psnr_db_mean"] >= 35
            acc[f"{name}: 3_int8_static_best ({best}) worst image >= 28 dB"] = statics[best]["psnr_db_min"] >= 28
        for label in ("int4-weights", "int4-weights 8bit-sensitive", "int4-weights 8bit-sensitive asym-b64"):
            if label in rec:
                e = rec[label]
                acc[f"{name}: 3_{label} mean >= 32 dB"] = e["psnr_db_mean"] >= 32
                acc[f"{name}: 3_{label} size >= 3.5x"] = (e["unet_size_ratio"] or 0) >= 3.5
                acc[f"{name}: 3_{label} latency <= fp32 (1/4/16 img)"] = not e["slower_than_fp32"]
        acc[f"{name}: 3_every_slower_recipe_says_so"] = all("SLOWER" in e["verdict"] for e in rec.values() if e["slower_than_fp32"])
    return acc


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(o):
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items() if not str(k).startswith("_")}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        if isinstance(o, (float, np.floating)):
            return float(o) if math.isfinite(o) else None
        if isinstance(o, np.integer):
            return int(o)
        return o

    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clean(result), indent=2) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
