#!/usr/bin/env python
"""Full size (SD1.5-sized, random weights): int8-static VAE decoder and text encoder, output SNR vs fp32
and speed (issue 16). Quality on random weights says only how much the int8 arithmetic moves the output
(the image-quality figures are the trained embedded models', experiments/quantize-embedded/component_quant_eval.py).

    python experiments/sd15/sd15_component_quant.py --fp32 $WORK/onnx256 --sampler-folder $WORK/int8-static-ext \\
        --work runs/sd15_components --out bench/report_sd15/component_quant.json [--folder $WORK/int8-static-ext]

1. Final latents of 6 prompts (seeds 0-5; 256x256, DDIM 10 steps, guidance 7.5) from --sampler-folder's
   pipeline (int8-static: 3x faster than fp32; only their distribution matters here): the first 4 calibrate
   the VAE decoder, the last 2 are held out; the text encoder calibrates on the first 4 prompts and "".
2. quantize/components.quantize_component on the fp32 folder's decoder and text encoder (what
   `quantize --recipe int8-static -O components=...` runs), saved under --work.
3. Output SNR vs fp32 on the held-out feeds; latency (1 thread, interleaved, medians) fp32 vs int8.
4. --folder: a copy of that folder (hard links) with the int8 decoder and text encoder installed, manifest
   hashes updated, at --work/folder (for sd15_breakdown.py / sd15_int8_measure.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from onnxdiffusion.folder.artifacts import MANIFEST, component_path, hash_tree, read_manifest, write_json  # noqa: E402
from onnxdiffusion.quantize import files  # noqa: E402
from onnxdiffusion.quantize.components import output_snr_db, quantize_component  # noqa: E402
from onnxdiffusion.quantize.runner import disabled_for, latency  # noqa: E402
from onnxdiffusion.folder.relayout import RUNTIME_EXTERNAL_BYTES  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

PROMPTS = ["a photo of an astronaut riding a horse", "a red car parked by the sea", "a bowl of fruit on a table",
           "a mountain lake at sunrise", "a cat sleeping on a windowsill", "an old lighthouse in a storm"]
CALIB = 4


def _install(src: Path, dst: Path, models: dict[str, onnx.ModelProto]) -> None:
    """dst = src (hard links) with these components replaced; manifest hashes remade."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, copy_function=os.link)
    manifest = read_manifest(src)
    for name, m in models.items():
        info = manifest["components"][name]
        rel = Path(info["path"])
        for old in [info["path"], *info.get("external_data", [])]:
            (dst / old).unlink()
        data = files.save(m, dst / rel, external_from=RUNTIME_EXTERNAL_BYTES)
        info["external_data"] = [str(rel.parent / f) for f in data]
        info["precision"] = "int8-static"
        info["bytes"] = sum((dst / rel.parent / f).stat().st_size for f in [rel.name, *data])
        disabled = disabled_for(m)
        if disabled:
            info["session_options"] = {"disabled_optimizers": list(disabled)}
        info.pop("validation", None)
    manifest["files"] = hash_tree(dst)
    (dst / MANIFEST).unlink()
    write_json(dst / MANIFEST, manifest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, required=True)
    ap.add_argument("--sampler-folder", type=Path, required=True)
    ap.add_argument("--folder", type=Path, help="also write --work/folder: this folder with the int8 components")
    ap.add_argument("--keep-float", action="append", default=[], help="default: int8-static's components_keep_float")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    args.work.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline.from_folder(args.sampler_folder, threads=1, memory="lean")
    lat_path = args.work / "final_latents.npy"
    if lat_path.exists():
        final = np.load(lat_path)
    else:
        t = time.time()
        final = np.concatenate([pipe(p, steps=10, sampler="ddim", guidance=7.5, seed=i).latents for i, p in enumerate(PROMPTS)])
        np.save(lat_path, final)
        log(f"final latents: {time.time() - t:.0f} s")
    h = w = pipe.info["default_height"]
    vae_feeds = [{"latent_sample": pipe.family.decoder_feed(pipe.info, final[i:i + 1], h, w)} for i in range(len(final))]
    tok = pipe.tokenizers["text_encoder"]
    te_calib = [{"input_ids": tok([p])} for p in [*PROMPTS[:CALIB], ""]]
    te_held = [{"input_ids": tok([p])} for p in PROMPTS[CALIB:]]
    del pipe
    manifest = read_manifest(args.fp32)
    from onnxdiffusion.quantize import Int8StaticRecipe

    keep = tuple(args.keep_float) or Int8StaticRecipe().components_keep_float  # the recipe's default
    result = {"settings": {"size": h, "steps": 10, "guidance": 7.5, "calibration_prompts": CALIB,
                           "held_out": len(PROMPTS) - CALIB, "keep_float": list(keep), "threads": 1}, "components": {}}
    models = {}
    for name, calib, held in (("vae_decoder", vae_feeds[:CALIB], vae_feeds[CALIB:]), ("text_encoder", te_calib, te_held)):
        src = component_path(args.fp32, manifest, name)
        fp32 = onnx.load(str(src))
        t = time.time()
        q, details = quantize_component(fp32, calib, keep, 1)
        details["quantize_s"] = round(time.time() - t, 1)
        details["held_out_output_snr_db"] = round(output_snr_db(fp32, q, held, 1), 2)
        details["calibration_output_snr_db"] = details.pop("output_snr_db")
        path = args.work / f"{name}.onnx"
        files.save(q, path, external_from=RUNTIME_EXTERNAL_BYTES)
        t = latency({"fp32": src, "int8": path}, held[0], 1, args.runs)
        details.update(fp32_ms=round(t["fp32"]["median_ms"], 1), int8_ms=round(t["int8"]["median_ms"], 1),
                       speedup=round(t["fp32"]["median_ms"] / t["int8"]["median_ms"], 2),
                       fp32_bytes=manifest["components"][name]["bytes"], int8_bytes=files.model_bytes(q))
        details["float_nodes"] = details["float_nodes"][:40]
        log(f"{name}: {json.dumps({k: v for k, v in details.items() if k != 'float_nodes'})}")
        result["components"][name] = details
        models[name] = q
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.folder:
        _install(args.folder, args.work / "folder", models)
        log(f"wrote {args.work / 'folder'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
