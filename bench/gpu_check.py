"""The measurements behind bench/gpu_check.sh (run that, not this, on a lent GPU).

On each embedded model (or the folders given as arguments): fp32 images on the CPU provider are the
reference; then, per configuration, images (PSNR vs the CPU ones, each model's recommended sampler,
steps and guidance) and the backbone call's median latency for 1 and 16 images (guided, interleaved
repeats). Configurations: CPU fp8 (float simulation), CUDA fp32 / fp16 (device IO binding; fp16 with
and without CUDA graph capture) / fp8 QDQ, TensorRT fp32 / fp16 / fp8 (engine cache, shape profiles
from the buckets); a configuration whose provider did not load is an error row, not a fallback's
figures. Writes bench/results/gpu_check.json and prints a table.
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

MODELS = [ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"]
PROMPTS = ["a red circle on the left", "a blue square at the top", "a green triangle", "a yellow star on the right"]
WANTED = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def profile(name, provider, **kw) -> Profile:
    d = {"version": 1, "name": name, "provider": provider, "io_binding": "device", "precision": "any", **kw}
    if provider == "tensorrt":
        d.setdefault("engine_cache", "tensorrt-engines-gpu-check")
        d.setdefault("shapes", {"batch": [1, 1, 4], "buckets": "model"})
    return Profile.from_dict(d, f"{name} (gpu_check)")


def images(pipe: Pipeline) -> np.ndarray:
    """The model's recommended sampler, steps and guidance (manifest), seeded latents per prompt."""
    lat = item_latents(pipe.latent_shape_for(1)[1:], list(range(len(PROMPTS))))
    return np.concatenate([pipe([p], latents=lat[i:i + 1]).images for i, p in enumerate(PROMPTS)])


def step_ms(pipes: dict[str, Pipeline], batch: int = 1, repeats: int = 50) -> dict[str, float | str]:
    """Median ms of one guided backbone call (`batch` images = 2x rows), interleaved across configurations."""
    from onnxdiffusion.runtime.backbone import DeviceBackbone, GuidedBackbone

    fns, out = {}, {}
    for k, p in pipes.items():
        try:
            shape = p.latent_shape_for(batch)
            cond = p.encode_prompt(["a red circle"] * batch)
            uncond = p.encode_prompt([""] * batch)
            device = p.profile is not None and p.profile.profile.io_binding == "device"
            guidance = float((p.recommended or {}).get("guidance", 4.0))
            fn = (DeviceBackbone(p.backbone, shape, cond, uncond, guidance, pool=p.device_pool) if device
                  else GuidedBackbone(p.backbone, shape, cond, uncond, guidance))
            x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            for _ in range(5):
                fn(x, 500.0)
            fns[k] = (fn, x)
        except Exception as e:  # noqa: BLE001 - e.g. a CUDA graph captured for another batch
            out[k] = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (fn, x) in fns.items():
            t0 = time.perf_counter()
            fn(x, 500.0)
            times[k].append(time.perf_counter() - t0)
    return out | {k: float(np.median(v) * 1e3) for k, v in times.items()}


def check_model(model: Path, have: list[str], work: Path) -> dict:
    result = {"rows": {}}
    t0 = time.time()
    cpu = Pipeline.from_folder(model, threads=None)
    rec = cpu.recommended or {}
    cal = CalibrationConfig(count=8, batch=8, **{k: rec[k] for k in ("sampler", "steps", "guidance") if k in rec})
    fp16 = work / f"{model.name}-fp16"
    quantize(model, fp16, QuantizeConfig(recipe=Fp16Recipe(), calibration=cal, latency_runs=1, measure_memory=False))
    # every layer FP8 (no 16-bit search: its CPU sensitivity pass would not fit the check's time)
    fp8 = work / f"{model.name}-fp8"
    try:
        quantize(model, fp8, QuantizeConfig(recipe=Fp8Recipe(keep_16bit="none"), calibration=cal, latency_runs=1, measure_memory=False))
    except Exception as e:  # noqa: BLE001 - reported as the fp8 rows' error
        result["fp8_quantize_error"] = str(e).strip().splitlines()[0][:300]
        fp8 = None
    result["quantize_seconds"] = round(time.time() - t0, 1)
    ref = images(cpu)
    configs = {"cpu fp32": (model, None)}
    if fp8:
        configs["cpu fp8 (float simulation)"] = (fp8, None)
    if "CUDAExecutionProvider" in have:
        configs |= {"cuda fp32": (model, profile("cuda-fp32", "cuda")),
                    "cuda fp16": (fp16, profile("cuda-fp16-nograph", "cuda")),
                    "cuda fp16 + CUDA graph": (fp16, profile("cuda-fp16-graph", "cuda", cuda_graph=True,
                                                             shapes={"batch": [1, 1, 1], "buckets": "model"}))}
        if fp8:
            configs["cuda fp8 (QDQ)"] = (fp8, profile("cuda-fp8", "cuda"))
    if "TensorrtExecutionProvider" in have:
        configs |= {"tensorrt fp32": (model, profile("trt-fp32", "tensorrt")),
                    "tensorrt fp16": (model, profile("trt-fp16", "tensorrt", provider_options={"trt_fp16_enable": "1"}))}
        if fp8:
            configs["tensorrt fp8"] = (fp8, profile("trt-fp8", "tensorrt", provider_options={"trt_fp16_enable": "1"}))
    pipes = {}
    for name, (folder, prof) in configs.items():
        try:
            pipes[name] = Pipeline.from_folder(folder, profile=prof) if prof else (
                cpu if folder == model else Pipeline.from_folder(folder, threads=None))
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
    for batch in (1, 16):
        # a captured CUDA graph replays the shapes it was captured with: 16 images would time a 1-image replay
        runnable = {k: p for k, p in pipes.items() if batch == 1 or not (p.profile and p.profile.profile.cuda_graph)}
        for name, ms in step_ms(runnable, batch).items():
            key = "step_ms" if batch == 1 else f"step_ms_batch{batch}"
            result["rows"][name][key] = round(ms, 3) if isinstance(ms, float) else f"failed: {ms}"
    rows = result["rows"]

    def ratio(a, b, key="step_ms"):
        ok = isinstance(rows.get(a, {}).get(key), float) and isinstance(rows.get(b, {}).get(key), float)
        return round(rows[a][key] / rows[b][key], 3) if ok else None

    result["ratios"] = {"cuda fp16 / cuda fp32": ratio("cuda fp16", "cuda fp32"),
                        "cuda fp16 / cuda fp32 (16 images)": ratio("cuda fp16", "cuda fp32", "step_ms_batch16"),
                        "cuda fp8 QDQ / cuda fp32": ratio("cuda fp8 (QDQ)", "cuda fp32"),
                        "cuda graph on / off (fp16)": ratio("cuda fp16 + CUDA graph", "cuda fp16"),
                        "tensorrt fp16 / tensorrt fp32": ratio("tensorrt fp16", "tensorrt fp32"),
                        "tensorrt fp8 / tensorrt fp32": ratio("tensorrt fp8", "tensorrt fp32"),
                        "tensorrt / cuda (fp32)": ratio("tensorrt fp32", "cuda fp32"),
                        "cuda fp32 / cpu fp32": ratio("cuda fp32", "cpu fp32"),
                        "cuda fp32 / cpu fp32 (16 images)": ratio("cuda fp32", "cpu fp32", "step_ms_batch16")}
    return result


def markdown(result: dict) -> str:
    """The committed table: per model, each configuration's image parity and step latency."""
    md = [f"# GPU path (`bench/gpu_check.sh`), onnxruntime-gpu {result['onnxruntime']}", ""]
    for k, v in result.get("run", {}).items():
        md.append(f"- {k}: {v}")
    for name, r in result["models"].items():
        md += ["", f"## {name}", "", "| configuration | PSNR vs CPU fp32 (dB) | step, 1 image (ms) | step, 16 images (ms) | ran on |",
               "|---|---:|---:|---:|---|"]
        for conf, row in r["rows"].items():
            if "error" in row:
                md.append(f"| {conf} | - | - | - | not run: {row['error']} |")
                continue
            md.append(f"| {conf} | {row['psnr_vs_cpu_db']:.2f} | {row.get('step_ms', '-')} | "
                      f"{row.get('step_ms_batch16', '-')} | {row['backbone_ran_on']} |")
        md += ["", "| ratio | value |", "|---|---:|"]
        md += [f"| {k} | {'not measured' if v is None else v} |" for k, v in r["ratios"].items()]
        if r.get("fp8_quantize_error"):
            md.append(f"\nfp8 quantize failed: {r['fp8_quantize_error']}")
    return "\n".join(md) + "\n"


def main() -> int:
    if not gpu_visible():
        print("gpu_check: skipped: no NVIDIA GPU visible")
        return 0
    import onnxruntime as ort

    models = [Path(a) for a in sys.argv[1:]] or [m for m in MODELS if (m / "manifest.json").exists()]
    have = ort.get_available_providers()
    result = {"onnxruntime": ort.__version__, "providers": have, "models": {}}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    for model in models:
        result["models"][model.name] = check_model(model, have, work)
    out = ROOT / "bench" / "results" / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    for name, r in result["models"].items():
        print(f"\n{name}\n{'configuration':28s} {'PSNR vs CPU (dB)':>17s} {'step ms':>9s} {'16 img ms':>10s}")
        for conf, row in r["rows"].items():
            p = f"{row['psnr_vs_cpu_db']:.2f}" if "psnr_vs_cpu_db" in row else row.get("error", "-")[:60]
            b1, b16 = row.get("step_ms", "-"), row.get("step_ms_batch16", "-")
            print(f"{conf:28s} {p:>17s} {str(b1)[:9]:>9s} {str(b16)[:10]:>10s}")
        for k, v in r["ratios"].items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
