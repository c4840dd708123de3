"""Loopback load test of `onnxdiffusion serve` (issue 14, acceptance 2 and the serving half of 5).

50 concurrent clients send a fixed number of OpenAI-style requests each (mixed sizes, samplers and,
in the `mixed` scenario, models). Every response is checked against its own request: echoed prompt,
seed, model and bucket, and the image must equal what the library's `Pipeline` (what `generate`
runs) renders in-process for the same settings. A 503 (queue full) is an intended answer: the client
waits `Retry-After` and retries; it is counted, never a failure.

Local mode: two servers (micro-batching on: --max-batch 4; off: --max-batch 1), each serving fp32
and an int8-dynamic copy; scenarios interleaved over repeats. `--ray`: `serve --ray --replicas 1`
vs `--replicas 2` (fp32, micro-batching on), interleaved.

    PYTHONPATH=src python bench/serve_load.py --out bench/results/serve_load
    PYTHONPATH=src python bench/serve_load.py --ray --out bench/results/serve_ray
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "shapes-sd-onnx"
PROMPTS = ["a small red circle on the left", "a blue star above a yellow square", "a large green triangle",
           "a purple square below an orange circle", "a yellow ring at the top", "two blue circles",
           "a red triangle right of a green star", "an orange square"]
SIZES = ["64x64", "64x64", "100x90", "128x128", "64x64", "48x64"]
BUCKETS = "64x64,128x128"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def start_server(models: dict[str, Path], *extra: str, ready_timeout: float = 300) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "onnxdiffusion.cli", "serve", *[f"{k}={v}" for k, v in models.items()],
           "--port", str(port), "--buckets", BUCKETS, *extra]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load_{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: see {log.name}")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"server not ready in {ready_timeout} s: see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def make_requests(clients: int, per_client: int, models: list[str], steps: int) -> list[list[dict]]:
    out = []
    for c in range(clients):
        reqs = []
        for j in range(per_client):
            k = c * per_client + j
            reqs.append({"prompt": PROMPTS[k % len(PROMPTS)], "seed": 1000 + k, "size": SIZES[k % len(SIZES)],
                         "steps": steps, "sampler": "euler_a" if k % 4 == 3 else "ddim", "guidance": 7.5,
                         "model": models[k % len(models)], "response_format": "b64_json"})
        out.append(reqs)
    return out


async def run_load(url: str, plan: list[list[dict]]) -> dict:
    results, rejected = [], 0
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one_client(reqs):
            nonlocal rejected
            for req in reqs:
                t0 = time.perf_counter()
                while True:
                    resp = await client.post("/v1/images/generations", json=req)
                    if resp.status_code != 503:
                        break
                    rejected += 1
                    await asyncio.sleep(min(float(resp.headers.get("retry-after", 1)), 2.0))
                results.append((req, resp.status_code, resp.json(), time.perf_counter() - t0))

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(r) for r in plan))
        wall = time.perf_counter() - t0
    return {"results": results, "rejected": rejected, "wall": wall}


def summarize(name: str, load: dict) -> dict:
    results = load["results"]
    ok = [r for r in results if r[1] == 200]
    lat = np.array([r[3] for r in ok]) * 1000
    images = sum(len(r[2]["data"]) for r in ok)
    return {
        "scenario": name, "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "rejected_503_retried": load["rejected"], "wall_s": round(load["wall"], 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
        "throughput_rps": round(len(ok) / load["wall"], 2), "images_per_s": round(images / load["wall"], 2),
        "mean_batch": round(float(np.mean([r[2]["timings"]["batch_size"] for r in ok])), 2) if ok else None,
    }


def expected_bucket(size: str) -> str:
    from onnxdiffusion.serve.manager import nearest_bucket, parse_buckets, parse_size

    w, h = nearest_bucket(*parse_size(size), parse_buckets(BUCKETS))
    return f"{w}x{h}"


class Checker:
    """Each response vs its own request, and its image vs the in-process pipeline (cached per settings)."""

    def __init__(self, folders: dict[str, Path]):
        from onnxdiffusion.runtime import Pipeline

        self.pipes = {k: Pipeline.from_folder(v, threads=1) for k, v in folders.items()}
        self.cache: dict[tuple, np.ndarray] = {}

    def reference(self, model: str, req: dict) -> np.ndarray:
        bucket = expected_bucket(req["size"])
        key = (model, req["prompt"], req["seed"], req["steps"], req["sampler"], req["guidance"], bucket)
        if key not in self.cache:
            w, h = map(int, bucket.split("x"))
            self.cache[key] = self.pipes[model](req["prompt"], seed=req["seed"], steps=req["steps"],
                                                sampler=req["sampler"], guidance=req["guidance"], width=w,
                                                height=h).images[0]
        return self.cache[key]

    def check(self, results) -> list[str]:
        from PIL import Image

        problems = []
        for req, status, body, _ in results:
            if status != 200:
                problems.append(f"status {status}: {body}")
                continue
            s = body["settings"]
            if (s["prompt"], s["seed"], s["model_requested"], s["bucket"]) != (
                    req["prompt"], req["seed"], req["model"], expected_bucket(req["size"])):
                problems.append(f"echo mismatch for seed {req['seed']}: {s}")
                continue
            if body["data"][0]["revised_prompt"] != req["prompt"]:
                problems.append(f"revised_prompt mismatch for seed {req['seed']}")
            img = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).convert("RGB"))
            if not np.array_equal(img, self.reference(s["model"], req)):
                problems.append(f"image differs from generate for seed {req['seed']} ({s['model']}, {s['bucket']})")
        return problems


def make_int8(cache: Path) -> Path:
    folder = cache / "shapes-sd-int8-dynamic"
    if not (folder / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxdiffusion.cli", "quantize", str(EMBEDDED), str(folder),
                        "--recipe", "int8-dynamic", "--calib-count", "4", "--calib-steps", "4", "--latency-runs", "3"],
                       env=env(), check=True, capture_output=True)
    return folder


def table(rows: list[dict]) -> str:
    cols = ["scenario", "requests", "ok", "failed", "rejected_503_retried", "mismatches", "p50_ms", "p99_ms",
            "throughput_rps", "images_per_s", "mean_batch"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def median_rows(runs: list[dict]) -> list[dict]:
    names = list(dict.fromkeys(r["scenario"] for r in runs))
    out = []
    for name in names:
        rs = [r for r in runs if r["scenario"] == name]
        row = {"scenario": name, "repeats": len(rs)}
        for k in ("requests", "ok", "failed", "rejected_503_retried", "mismatches"):
            row[k] = sum(r[k] for r in rs)
        for k in ("p50_ms", "p99_ms", "throughput_rps", "images_per_s", "mean_batch"):
            row[k] = round(statistics.median(r[k] for r in rs), 2)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-queue", type=int, default=32, help="below --clients, so 503 + Retry-After is exercised")
    ap.add_argument("--ray", action="store_true")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "serve-load-cache")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    folders = {"fp32": EMBEDDED}
    common = ["--max-queue", str(args.max_queue), "--timeout", "600"]
    if args.ray:
        servers = {f"ray-{n}-replica{'s' if n > 1 else ''}": ({"fp32": EMBEDDED}, ["--ray", "--replicas", str(n)])
                   for n in (1, 2)}
        scenarios = [("fp32", ["fp32"])]
    else:
        folders["int8"] = make_int8(args.cache)
        servers = {"batching": (folders, ["--max-batch", "4"]), "no-batching": (folders, ["--max-batch", "1"])}
        scenarios = [("fp32", ["fp32"]), ("int8", ["int8"]), ("mixed", ["fp32", "int8"])]
    checker = Checker(folders)
    runs, problems = [], []
    live = {} if args.ray else {name: start_server(m, *common, *extra) for name, (m, extra) in servers.items()}
    try:
        for rep in range(args.repeats):
            for name, (models, extra) in servers.items():
                if args.ray:  # one Ray cluster at a time
                    proc, url = start_server(models, *common, *extra)
                else:
                    proc, url = live[name]
                for scen, scen_models in scenarios:
                    plan = make_requests(args.clients, args.requests, scen_models, args.steps)
                    load = asyncio.run(run_load(url, plan))
                    row = summarize(f"{scen} / {name}", load)
                    bad = checker.check(load["results"])
                    row["mismatches"], row["repeat"] = len(bad), rep
                    problems += bad[:5]
                    runs.append(row)
                    print(json.dumps(row), flush=True)
                if args.ray:
                    stop_server(proc)
    finally:
        for proc, _ in live.values():
            stop_server(proc)
    summary = median_rows(runs)
    result = {
        "what": "loopback load test of onnxdiffusion serve" + (" on Ray Serve" if args.ray else ""),
        "machine": {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "note": "shared, noisy 2-core machine (other jobs running): absolute numbers swing ~2x; "
                            "scenarios are interleaved and medians of repeats are reported"},
        "settings": {"clients": args.clients, "requests_per_client": args.requests, "steps": args.steps,
                     "sizes": SIZES, "buckets": BUCKETS, "samplers": "ddim (3/4), euler_a (1/4)", "guidance": 7.5,
                     "max_queue": args.max_queue, "repeats": args.repeats,
                     "servers": {k: v[1] for k, v in servers.items()}},
        "summary": summary, "runs": runs, "problems": problems[:20],
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# {result['what']}", "", f"Machine: {result['machine']['note']}.", "",
          f"{args.clients} concurrent clients x {args.requests} requests, {args.steps} steps, sizes {', '.join(SIZES)} "
          f"(buckets {BUCKETS}), max queue {args.max_queue} (503s are retried after Retry-After). "
          "`mismatches` counts responses whose echo or image differs from `generate` with the same settings.",
          "", "Medians over repeats:", "", table(summary), "", "Every run:", "", table(runs), ""]
    (args.out / "results.md").write_text("\n".join(md))
    print(table(summary))
    if problems:
        print("PROBLEMS:", *problems[:10], sep="\n")


if __name__ == "__main__":
    main()
