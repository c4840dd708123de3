"""Issue 45's numbers: the A1111 routes against the library, LoRA tags, derived insertion points, serve's defaults.

    python experiments/a1111/measure.py            # ~2 min on 2 shared CPU cores; prints a markdown table

Everything in process (FastAPI's TestClient runs the app and its queue), one worker, the embedded models.
"""

from __future__ import annotations

import base64
import io
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SD, MMDIT, LORAS = ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx", ROOT / "models" / "loras"


def psnr(a, b) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def png(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def best(fn, runs=3) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    os.environ["ONNXDIFFUSION_CACHE"] = tempfile.mkdtemp(prefix="a1111-measure-")
    from fastapi.testclient import TestClient

    from onnxdiffusion.adapters.folder import with_points
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    rows = []
    quiet = lambda m: None  # noqa: E731
    for name, folder in (("sd", SD), ("mmdit", MMDIT)):
        t0 = time.perf_counter()
        derived = with_points(folder, log=quiet)
        first = time.perf_counter() - t0
        cached = best(lambda: with_points(folder, log=quiet))
        plain, points = Pipeline.from_folder(folder, threads=1), Pipeline.from_folder(derived, threads=1)
        a, b = plain("a red circle", seed=1).images[0], points("a red circle", seed=1).images[0]
        ta, tb = best(lambda: plain("a red circle", seed=1)), best(lambda: points("a red circle", seed=1))
        rows.append((f"points copy of {name}: derive / cached lookup", f"{first:.2f} s / {cached * 1e3:.1f} ms"))
        rows.append((f"{name} plain vs derived copy, no adapter (20 steps)",
                     f"PSNR {psnr(a, b)} dB; {ta:.3f} s vs {tb:.3f} s per image"))
    pipe = Pipeline.from_folder(SD, threads=1)
    config = ServeConfig(models=(f"sd={SD}", f"mmdit={MMDIT}"), workers=1, lora_dir=str(LORAS))
    t0 = time.perf_counter()
    with TestClient(create_app(config)) as c:
        while not c.get("/ready").json()["ready"]:
            time.sleep(0.05)
        rows.append(("in-process start to ready, both models + adapters, no --buckets", f"{time.perf_counter() - t0:.1f} s"))
        body = {"prompt": "a blue star above a yellow square", "seed": 7, "steps": 20, "cfg_scale": 4.0, "width": 64,
                "height": 64}
        for a_name, ours in (("DDIM", "ddim"), ("Euler a", "euler_a"), ("DPM++ 2M", "dpmpp_2m")):
            r = c.post("/sdapi/v1/txt2img", json={**body, "sampler_name": a_name})
            want = pipe(body["prompt"], seed=7, steps=20, guidance=4.0, sampler=ours).images[0]
            rows.append((f"txt2img {a_name} vs library", f"PSNR {psnr(png(r.json()['images'][0]), want)} dB"))
        start = pipe("a red circle on the left", seed=0).images[0]
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(start).save(buf, format="PNG")
        mask = np.zeros((64, 64), np.uint8)
        mask[8:40, 24:56] = 255
        mbuf = io.BytesIO()
        Image.fromarray(mask).save(mbuf, format="PNG")
        init = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        r = c.post("/sdapi/v1/img2img", json={**body, "sampler_name": "DDIM", "init_images": [init],
                                                "denoising_strength": 0.6})
        want = pipe(body["prompt"], image=start, strength=0.6, seed=7, steps=20, guidance=4.0, sampler="ddim").images[0]
        rows.append(("img2img strength 0.6 vs library", f"PSNR {psnr(png(r.json()['images'][0]), want)} dB"))
        r = c.post("/sdapi/v1/img2img", json={**body, "sampler_name": "DDIM", "init_images": [init], "mask_blur": 4,
                                                "mask": base64.b64encode(mbuf.getvalue()).decode(),
                                                "denoising_strength": 0.9})
        want = pipe(body["prompt"], image=start, mask=mask, mask_blur=4.0, strength=0.9, seed=7, steps=20, guidance=4.0,
                    sampler="ddim").images[0]
        rows.append(("inpainting (mask, blur 4) vs library", f"PSNR {psnr(png(r.json()['images'][0]), want)} dB"))
        tag = c.post("/sdapi/v1/txt2img", json={**body, "sampler_name": "DDIM",
                                                 "prompt": body["prompt"] + " <lora:shapes-sd-violet:0.8>"})
        field = c.post("/v1/images/generations", json={"prompt": body["prompt"], "seed": 7, "steps": 20,
                                                       "guidance": 4.0, "sampler": "ddim", "size": "64x64",
                                                       "lora": ["shapes-sd-violet:0.8"]})
        rows.append(("LoRA by tag (A1111) vs `lora` field (OpenAI)",
                     f"PSNR {psnr(png(tag.json()['images'][0]), png(field.json()['data'][0]['b64_json']))} dB"))
        c.post("/sdapi/v1/options", json={"sd_model_checkpoint": "mmdit"})
        r = c.post("/sdapi/v1/txt2img", json={**body, "sampler_name": "Euler", "cfg_scale": 3.0})
        mm = Pipeline.from_folder(MMDIT, threads=1)
        want = mm(body["prompt"], seed=7, steps=20, guidance=3.0, sampler="flow_euler").images[0]
        rows.append(("mmdit via options, Euler (flow_euler) vs library", f"PSNR {psnr(png(r.json()['images'][0]), want)} dB"))
        c.post("/sdapi/v1/options", json={"sd_model_checkpoint": "sd"})
        dd = {**body, "sampler_name": "DDIM"}
        t_a = best(lambda: c.post("/sdapi/v1/txt2img", json=dd))
        t_o = best(lambda: c.post("/v1/images/generations", json={"prompt": body["prompt"], "seed": 7, "steps": 20,
                                                                  "guidance": 4.0, "sampler": "ddim", "size": "64x64"}))
        t_l = best(lambda: pipe(body["prompt"], seed=7, steps=20, guidance=4.0, sampler="ddim"))
        rows.append(("one 64x64 image, 20 DDIM steps: A1111 route / OpenAI route / library",
                     f"{t_a:.3f} / {t_o:.3f} / {t_l:.3f} s"))
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("r", c.post("/sdapi/v1/txt2img", json={
            **body, "sampler_name": "DDIM", "steps": 100, "width": 128, "height": 128})))
        th.start()
        while (p := c.get("/sdapi/v1/progress").json())["state"]["sampling_step"] < 3 or not p["current_image"]:
            time.sleep(0.02)
        t0 = time.perf_counter()
        c.post("/sdapi/v1/interrupt")
        th.join()
        rows.append(("interrupt at step >= 3 of 100 (128x128): until the request answers",
                     f"{(time.perf_counter() - t0) * 1e3:.0f} ms (HTTP {out['r'].status_code}, images "
                     f"{len(out['r'].json()['images'])})"))
    print("| what | measured |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    sys.exit(main())
