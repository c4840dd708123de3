"""The tiny decoder against the VAE decoder: image PSNR, judge accuracy, decoder time; and the 512x512 check.

  python experiments/tiny-vae/measure.py models  [--count 32] [--cache DIR] [--out results.json]
      per shipped model (both embedded models): N held-out prompts sampled once (the model's recommended
      settings, evaluate's seeds), their final latents decoded by the VAE decoder and by the tiny decoder;
      PSNR (tiny vs full, first 32 images), judge accuracy of each set,
      and the decoders' CPU time on one thread (batch 1, the model's 64x64 images).
      --tiny DIR: decode with a diffusers AutoencoderTiny folder (a training checkpoint, PyTorch, its float16
      weights) instead of the folder's vae_decoder_tiny; no timing. For checks between training rounds.
  python experiments/tiny-vae/measure.py sd512 [--out results_512.json]
      diffusers-default AutoencoderKL (SD's VAE config) vs diffusers-default AutoencoderTiny (TAESD's), random
      weights, decoders exported to ONNX at 64x64 latents (512x512 images), ORT on one thread, CPU time.

Run from the repository root with PYTHONPATH=src; set OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODELS = (ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def cpu_seconds(fn, repeats: int, warmup: int = 1) -> dict:
    """CPU time of this process per call (one thread: wall time less what other processes took)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def sample_once(pipe, folder: Path, scenes, options, cache: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """(final latents, the VAE decoder's images) of the held-out prompts; kept in `cache` (sampling is the
    slow part and does not depend on the tiny decoder, so it can run while the tiny model still trains)."""
    from onnxdiffusion.evaluate.run import generate_set
    from onnxdiffusion.runtime import GenerationResult

    path = None if cache is None else cache / f"{folder.name}-{len(scenes)}-{options.steps}-{options.sampler}.npz"
    if path is not None and path.is_file():
        data = np.load(path)
        return data["latents"], data["images"]
    latents: list[np.ndarray] = []

    def keep(start, event):
        if isinstance(event, GenerationResult):
            latents.append(event.latents)

    full = generate_set(pipe, scenes, options, progress=False, step_callback=keep)
    z = np.concatenate(latents)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, latents=z, images=full)
    return z, full


def torch_tiny_decode(pipe, tiny_folder: Path, z: np.ndarray, batch: int) -> np.ndarray:
    """`pipe.decode(z, decoder="tiny")` with a PyTorch AutoencoderTiny folder in place of the ONNX decoder."""
    import torch
    from diffusers import AutoencoderTiny

    from onnxdiffusion.runtime.generation import GenerateOptions
    from onnxdiffusion.runtime.tiny_decoder import TinyDecoder

    torch.set_num_threads(1)
    model = AutoencoderTiny.from_pretrained(tiny_folder).float().eval()
    h, w = pipe.image_size(pipe.resolve(GenerateOptions()))
    feed, _ = TinyDecoder(pipe).prepare(z, h, w)  # the folder's scaling / shift, as the run time feeds it
    out = []
    with torch.no_grad():
        for i in range(0, len(feed), batch):
            x = model.decode(torch.from_numpy(np.ascontiguousarray(feed[i : i + batch]))).sample.numpy()
            image = np.clip(pipe.family.decoded_images(x) / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1)
            out.append((image * 255).round().astype(np.uint8))
    return np.concatenate(out)


def measure_model(folder: Path, count: int, batch: int, cache: Path | None = None,
                  tiny_folder: Path | None = None) -> dict:
    from onnxdiffusion.evaluate import scenes as S
    from onnxdiffusion.folder.artifacts import component_path
    from onnxdiffusion.evaluate.judge import Judge, score_scenes, summarize
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.evaluate.run import EvaluateOptions
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.runtime.generation import GenerateOptions
    from onnxdiffusion.runtime.tiny_decoder import TinyDecoder

    pipe = Pipeline.from_folder(folder, threads=1)
    rec = pipe.resolve(GenerateOptions())  # the model's recommended settings, as evaluate uses them
    options = EvaluateOptions(count=count, steps=rec.steps, sampler=rec.sampler, guidance=rec.guidance, batch=batch)
    scenes = S.scenes("heldout", count)
    t0 = time.time()
    z, full = sample_once(pipe, folder, scenes, options, cache)
    # the same final latents through the tiny decoder: only the decoder differs between the two sets
    if tiny_folder is None:
        tiny = np.concatenate([pipe.decode(z[i : i + batch], decoder="tiny") for i in range(0, len(z), batch)])
    else:
        tiny = torch_tiny_decode(pipe, tiny_folder, z, batch)
    per_image = [psnr(a, b) for a, b in zip(tiny[:32], full[:32])]
    judge = Judge.from_file(None)
    acc = {name: summarize(score_scenes(scenes, judge.predict(images))) for name, images in (("full", full), ("tiny", tiny))}
    if tiny_folder is not None:
        return {"model": folder.name, "prompts": count, "tiny": str(tiny_folder),
                "psnr_tiny_vs_full_db": {"mean": float(np.mean(per_image)), "min": float(np.min(per_image)),
                                         "max": float(np.max(per_image)), "images": len(per_image)},
                "judge": acc, "seconds": round(time.time() - t0, 1)}
    h, w = pipe.image_size(rec)
    full_feed = pipe.family.decoder_feed(pipe.info, z[:1], h, w)
    tiny_feed, _ = TinyDecoder(pipe).prepare(z[:1], h, w)
    timed = {}
    for name, feed in (("vae_decoder", full_feed), ("vae_decoder_tiny", tiny_feed)):
        sess = session(component_path(folder, pipe.manifest, name))
        timed[name] = cpu_seconds(lambda: sess.run(["sample"], {"latent_sample": feed}), 20)
    return {
        "model": folder.name,
        "prompts": count,
        "options": {"steps": rec.steps, "sampler": rec.sampler, "guidance": rec.guidance},
        "psnr_tiny_vs_full_db": {"mean": float(np.mean(per_image)), "min": float(np.min(per_image)),
                                 "max": float(np.max(per_image)), "images": len(per_image)},
        "judge": acc,
        "decoder_cpu_seconds_1thread_batch1": {**timed, "speedup": timed["vae_decoder"]["median_s"]
                                               / timed["vae_decoder_tiny"]["median_s"]},
        "bytes": {n: pipe.manifest["components"][n]["bytes"] for n in ("vae_decoder", "vae_decoder_tiny")},
        "seconds": round(time.time() - t0, 1),
    }


def sd512() -> dict:
    import torch
    from diffusers import AutoencoderKL, AutoencoderTiny

    from onnxdiffusion.export.wrappers import TinyVaeDecoder, VaeDecoder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    z = torch.randn(1, 4, 64, 64)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make, wrap in (("AutoencoderKL (SD VAE)", lambda: AutoencoderKL(
                block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=512,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4), VaeDecoder),
                                 ("AutoencoderTiny (TAESD)", AutoencoderTiny, TinyVaeDecoder)):
            model = make().eval()
            params = sum(p.numel() for p in model.decoder.parameters()) + sum(
                p.numel() for p in getattr(model, "post_quant_conv", torch.nn.Identity()).parameters())
            path = Path(tmp) / "decoder.onnx"
            with torch.no_grad():
                torch.onnx.export(wrap(model), (z,), str(path), input_names=["latent_sample"], output_names=["sample"],
                                  opset_version=17, dynamo=False)
            del model
            sess = session(path)
            feed = {"latent_sample": z.numpy()}
            shape = sess.run(None, feed)[0].shape
            t = cpu_seconds(lambda: sess.run(None, feed), 3 if "Tiny" in name else 2, warmup=0)
            out[name] = {"decoder_params": params, "image": list(shape[1:]), **t}
            del sess
    kl, tiny = out.values()
    out["speedup"] = kl["median_s"] / tiny["median_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("models", "sd512"))
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--folders", nargs="*", type=Path, default=list(MODELS))
    p.add_argument("--out", type=Path)
    p.add_argument("--cache", type=Path, help="keep the sampled latents and VAE images here (e.g. runs/tiny-vae/measure)")
    p.add_argument("--tiny", type=Path, help="decode with this AutoencoderTiny folder (PyTorch), not the ONNX one")
    a = p.parse_args()
    import onnxruntime

    result = {"cpu": cpu_name(), "onnxruntime": onnxruntime.__version__, "threads": 1}
    if a.what == "models":
        result["models"] = [measure_model(f, a.count, a.batch, a.cache, a.tiny) for f in a.folders]
    else:
        result["sd512"] = sd512()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
