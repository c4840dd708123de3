"""The measurements behind bench/gpu_check.sh (run that, not this, on a lent GPU).

On the embedded model: fp32 images on the CPU provider are the reference; then, per GPU
configuration, images (PSNR vs the CPU ones) and the backbone call's median latency at the
guided batch of one image (interleaved repeats). Configurations: CUDA fp32 / fp16 (device IO
binding; fp16 with and without CUDA graph capture), TensorRT fp32 / fp16 / fp8 (engine cache,
shape profiles from the buckets). Writes bench/results/gpu_check.json and prints a table.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.evaluate.metrics import psnr  # noqa: E402
from onnxdiffusion.evaluate.run import item_latents  # noqa: E402
from onnxdiffusion.profiles import Profile, gpu_visible  # noqa: E402
from onnxdiffusion.quantize import CalibrationConfig, Fp8Recipe, Fp16Recipe, QuantizeConfig, quantize  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402

MODEL = ROOT / "models" / "shapes-sd-onnx"
PROMPTS = ["a red circle on the left", "a blue square at the top", "a green triangle", "a yellow star on the right"]
GEN = dict(steps=20, sampler="ddim", guidance=4.0)
WANTED = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def profile(name, provider, **kw) -> Profile:
    d = {"version": 1, "name": name, "provider": provider, "io_binding": "device", "precision": "any", **kw}
    if provider == "tensorrt":
        d.setdefault("engine_cache", "tensorrt-engines-gpu-check")
        d.setdefault("shapes", {"batch": [1, 1, 4], "buckets": "model"})
    return Profile.from_dict(d, f"{name} (gpu_check)")


def images(pipe: Pipeline) -> np.ndarray:
    lat = item_latents(pipe.latent_shape_for(1)[1:], list(range(len(PROMPTS))))
    return np.concatenate([pipe([p], latents=lat[i:i + 1], **GEN).images for i, p in enumerate(PROMPTS)])


def step_ms(pipes: dict[str, Pipeline], repeats: int = 50) -> dict[str, float]:
    """Median ms of one guided backbone call (batch 1 image = 2 rows), interleaved across configurations."""
    from onnxdiffusion.runtime.backbone import DeviceBackbone, GuidedBackbone

    fns = {}
    for k, p in pipes.items():
        shape = p.latent_shape_for(1)
        cond = p.encode_prompt(["a red circle"])
        uncond = p.encode_prompt([""])
        device = p.profile is not None and p.profile.profile.io_binding == "device"
        fns[k] = ((DeviceBackbone if device else GuidedBackbone)(p.backbone, shape, cond, uncond, 4.0),
                  np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    for fn, x in fns.values():
        for _ in range(5):
            fn(x, 500.0)
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (fn, x) in fns.items():
            t0 = time.perf_counter()
            fn(x, 500.0)
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v) * 1e3) for k, v in times.items()}


def main() -> int:
    if not gpu_visible():
        print("gpu_check: skipped: no NVIDIA GPU visible")
        return 0
    import onnxruntime as ort

    have = ort.get_available_providers()
    result = {"onnxruntime": ort.__version__, "providers": have, "rows": {}}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.time()
    fp16 = work / "fp16"
    quantize(MODEL, fp16, QuantizeConfig(recipe=Fp16Recipe(components=("unet",)), latency_runs=1, measure_memory=False))
    fp8 = work / "fp8"
    try:
        quantize(MODEL, fp8, QuantizeConfig(recipe=Fp8Recipe(), calibration=CalibrationConfig(count=8, batch=8),
                                             latency_runs=1, measure_memory=False))
    except Exception as e:  # noqa: BLE001 - reported as the fp8 rows' error
        result["fp8_quantize_error"] = str(e).strip().splitlines()[0][:300]
        fp8 = None
    result["quantize_seconds"] = round(time.time() - t0, 1)
    cpu = Pipeline.from_folder(MODEL, threads=None)
    ref = images(cpu)
    configs = {"cpu fp32": (MODEL, None)}
    if "CUDAExecutionProvider" in have:
        configs |= {"cuda fp32": (MODEL, profile("cuda-fp32", "cuda")),
                    "cuda fp16": (fp16, profile("cuda-fp16-nograph", "cuda")),
                    "cuda fp16 + CUDA graph": (fp16, profile("cuda-fp16-graph", "cuda", cuda_graph=True,
                                                             shapes={"batch": [1, 1, 1], "buckets": "model"}))}
    if "TensorrtExecutionProvider" in have:
        configs |= {"tensorrt fp32": (MODEL, profile("trt-fp32", "tensorrt")),
                    "tensorrt fp16": (MODEL, profile("trt-fp16", "tensorrt", provider_options={"trt_fp16_enable": "1"}))}
        if fp8:
            configs["tensorrt fp8"] = (fp8, profile("trt-fp8", "tensorrt", provider_options={"trt_fp16_enable": "1"}))
    pipes = {}
    for name, (folder, prof) in configs.items():
        try:
            pipes[name] = Pipeline.from_folder(folder, profile=prof) if prof else cpu
            imgs = images(pipes[name])
            ran_on = pipes[name].backbone.get_providers()[0]
            result["rows"][name] = {"psnr_vs_cpu_db": float(psnr(imgs, ref)), "backbone_ran_on": ran_on}
            wanted = WANTED.get(name.split()[0])
            if wanted and ran_on != wanted:  # ORT falls back silently (e.g. TensorRT's libraries absent)
                result["rows"][name] = {"error": f"{wanted} did not load; ORT fell back to {ran_on}"}
                pipes.pop(name)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a result, not the end
            result["rows"][name] = {"error": str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}
            pipes.pop(name, None)
    for name, ms in step_ms(pipes).items():
        result["rows"][name]["step_ms"] = round(ms, 3)
    rows = result["rows"]

    def ratio(a, b):
        return round(rows[a]["step_ms"] / rows[b]["step_ms"], 3) if "step_ms" in rows.get(a, {}) and "step_ms" in rows.get(b, {}) else None

    result["ratios"] = {"cuda fp16 / cuda fp32": ratio("cuda fp16", "cuda fp32"),
                        "cuda graph on / off (fp16)": ratio("cuda fp16 + CUDA graph", "cuda fp16"),
                        "tensorrt fp16 / tensorrt fp32": ratio("tensorrt fp16", "tensorrt fp32"),
                        "tensorrt fp8 / tensorrt fp32": ratio("tensorrt fp8", "tensorrt fp32"),
                        "tensorrt / cuda (fp32)": ratio("tensorrt fp32", "cuda fp32"),
                        "cuda fp32 / cpu fp32": ratio("cuda fp32", "cpu fp32")}
    out = ROOT / "bench" / "results" / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'configuration':26s} {'PSNR vs CPU (dB)':>17s} {'step ms':>9s}")
    for name, r in rows.items():
        p = f"{r['psnr_vs_cpu_db']:.2f}" if "psnr_vs_cpu_db" in r else r.get("error", "-")[:60]
        print(f"{name:26s} {p:>17s} {r.get('step_ms', float('nan')):9.3f}")
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
