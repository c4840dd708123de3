"""Soak test of `onnxdiffusion serve` (issue 27, acceptance 3): mixed load for a long time, leaks measured.

One server (both embedded models, API keys on, one worker) takes mixed traffic from a few client
threads for `--minutes`: synchronous OpenAI-style requests, jobs polled to the end, jobs cancelled
at a random moment, and progress-stream (SSE) clients that disconnect mid-stream; sizes from the
buckets each model keeps (the MMDiT keeps 64x64 only, its position table's limit), few steps (the
machine is shared: this is about correctness and leaks, not speed).

Checked per answer: the echoed prompt, seed, model and bucket are the request's, and the image
equals the first image seen for the same settings (every setting repeats: a fixed pool of 16), so a
response carrying another request's image is counted as mixed. A request with no final answer
(transport error, 5xx, a job stuck) is lost; 429/503 with Retry-After are rejections, counted apart.
Sampled every `--sample-every` s from /proc: the server's RSS, open file descriptors, threads.

    PYTHONPATH=src python bench/soak.py --minutes 30 --out bench/results/soak
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"sd": ROOT / "models" / "shapes-sd-onnx", "mmdit": ROOT / "models" / "shapes-mmdit-onnx"}
BUCKETS = "64x64,96x96,128x128"
KEYS = ("soak-key-aaaaaaaaaaaa", "soak-key-bbbbbbbbbbbb")
PROMPTS = ("a small red circle on the left", "a blue star above a yellow square", "a large green triangle",
           "a purple square below an orange circle")
SETTINGS = [  # (model, size, steps, seed, prompt index): the pool every request draws from
    (m, size, steps, seed, p)
    for m, sizes in (("sd", ("64x64", "96x96", "128x128")), ("mmdit", ("64x64",)))
    for size in sizes for steps, seed, p in ((2, 1, 0), (4, 2, 1), (3, 3, 2), (2, 4, 3))
][:16]
KINDS = (("sync", 0.40), ("job", 0.20), ("cancel", 0.15), ("sse_drop", 0.15), ("sse_full", 0.10))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stats(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": len(os.listdir(f"/proc/{pid}/task"))}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.latency: dict[str, list[float]] = {}
        self.golden: dict[tuple, str] = {}
        self.problems: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def problem(self, key: str, what: str) -> None:
        self.add(key)
        with self.lock:
            if len(self.problems) < 50:
                self.problems.append(f"{key}: {what}")

    def image(self, setting: tuple, png_b64: str) -> bool:
        """True when the image is the one this setting gave first (or is the first)."""
        digest = hashlib.sha256(base64.b64decode(png_b64)).hexdigest()
        with self.lock:
            return self.golden.setdefault(setting, digest) == digest


def check_answer(tally: Tally, setting: tuple, body: dict, images: list[str]) -> None:
    model, size, steps, seed, p = setting
    s = body["settings"]
    if (s["model"], s["bucket"], s["steps"], s["seed"], s["prompt"]) != (model, size, steps, seed, PROMPTS[p]):
        tally.problem("mixed", f"asked {setting}, got {s['model']} {s['bucket']} {s['steps']} {s['seed']} {s['prompt']!r}")
        return
    if len(images) != 1 or not tally.image(setting, images[0]):
        tally.problem("mixed", f"image differs from the first one for {setting}")
        return
    tally.add("ok")


def one_request(client: httpx.Client, tally: Tally, rng: random.Random) -> None:
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    setting = rng.choice(SETTINGS)
    model, size, steps, seed, p = setting
    body = {"prompt": PROMPTS[p], "model": model, "size": size, "steps": steps, "seed": seed, "n": 1}
    tally.add(f"sent_{kind}")
    t0 = time.perf_counter()
    if kind == "sync":
        r = client.post("/v1/images/generations", json=body)
        if r.status_code in (429, 503):
            tally.add("rejected")
            time.sleep(float(r.headers.get("retry-after", 1)))
            return
        if r.status_code != 200:
            tally.problem("lost", f"sync {r.status_code} {r.text[:200]}")
            return
        with tally.lock:
            tally.latency.setdefault(model, []).append(time.perf_counter() - t0)
        check_answer(tally, setting, r.json(), [d["b64_json"] for d in r.json()["data"]])
        return
    r = client.post("/v1/jobs", json={**body, "preview": kind.startswith("sse")})
    if r.status_code in (429, 503):
        tally.add("rejected")
        time.sleep(float(r.headers.get("retry-after", 1)))
        return
    if r.status_code != 202:
        tally.problem("lost", f"{kind} submit {r.status_code} {r.text[:200]}")
        return
    job = r.json()["id"]
    if kind == "cancel":
        time.sleep(rng.uniform(0, 0.5))
        c = client.delete(f"/v1/jobs/{job}")
        if c.status_code not in (200, 409):  # 409: it finished first
            tally.problem("lost", f"cancel {c.status_code} {c.text[:200]}")
            return
    if kind == "sse_drop":  # read one or two events, then hang up mid-stream
        with client.stream("GET", f"/v1/jobs/{job}/events") as s:
            if s.status_code != 200:
                tally.problem("lost", f"sse {s.status_code}")
                return
            events = 0
            for line in s.iter_lines():
                events += line.startswith("event: ")
                if events >= rng.randint(1, 2):
                    break
        tally.add("sse_dropped")
    if kind == "sse_full":
        with client.stream("GET", f"/v1/jobs/{job}/events") as s:
            last = None
            for line in s.iter_lines():
                if line.startswith("event: "):
                    last = line[7:]
            if last != "done":
                tally.problem("lost", f"sse stream ended without done (last {last})")
                return
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        snap = client.get(f"/v1/jobs/{job}").json()
        if snap["status"] in ("succeeded", "failed", "cancelled", "timeout"):
            break
        time.sleep(0.1)
    else:
        tally.problem("lost", f"job {job} never finished")
        return
    if snap["status"] == "cancelled" and kind == "cancel":
        tally.add("cancelled")
        return
    if snap["status"] != "succeeded":
        tally.problem("lost", f"{kind} job ended {snap['status']}: {snap['error']}")
        return
    res = client.get(f"/v1/jobs/{job}/result")
    if res.status_code != 200:
        tally.problem("lost", f"result {res.status_code}")
        return
    check_answer(tally, setting, res.json(), [d["b64_json"] for d in res.json()["data"]])


def client_loop(url: str, key: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            try:
                one_request(client, tally, rng)
            except httpx.HTTPError as e:
                tally.problem("lost", f"transport {type(e).__name__}: {e}")
                time.sleep(0.5)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-minutes", type=float, default=3.0, help="RSS growth is measured from after this")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=None, help="folder for soak.json + soak.md (default: print only)")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from onnxdiffusion.bench.setup import machine_info

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               ONNXDIFFUSION_API_KEYS=",".join(KEYS))
    cmd = [sys.executable, "-m", "onnxdiffusion.cli", "serve", *[f"{k}={v}" for k, v in MODELS.items()],
           "--port", str(port), "--buckets", BUCKETS, "--workers", "1", "--max-queue", "16", "--retention", "60"]
    log = open(os.devnull, "w") if args.out is None else open(args.out.with_suffix(".server.log"), "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, "server exited"
            time.sleep(0.5)
        tally, stop = Tally(), threading.Event()
        threads = [threading.Thread(target=client_loop, args=(url, KEYS[i % 2], tally, stop, i), daemon=True)
                   for i in range(args.clients)]
        t0 = time.monotonic()
        samples = [{"t": 0.0, **proc_stats(server.pid)}]
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(min(args.sample_every, max(0.1, args.minutes * 60 - (time.monotonic() - t0))))
            samples.append({"t": round(time.monotonic() - t0, 1), **proc_stats(server.pid)})
            done = sum(tally.counts.get(k, 0) for k in ("ok", "cancelled", "rejected", "lost", "mixed"))
            print(f"[soak] {samples[-1]['t']:7.0f}s rss {samples[-1]['rss'] / 2**20:6.1f} MiB fds {samples[-1]['fds']} "
                  f"threads {samples[-1]['threads']} answers {done} lost {tally.counts.get('lost', 0)} "
                  f"mixed {tally.counts.get('mixed', 0)}", file=sys.stderr, flush=True)
        stop.set()
        for t in threads:
            t.join(360)
        time.sleep(2)  # finished jobs let go of their streams
        samples.append({"t": round(time.monotonic() - t0, 1), **proc_stats(server.pid)})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    warm = [s for s in samples if s["t"] >= args.warmup_minutes * 60] or samples[-1:]
    base = warm[0]
    tail = [s for s in samples if s["t"] >= samples[-1]["t"] - 300] or samples[-1:]
    rss_growth = (statistics.median(s["rss"] for s in tail) - base["rss"]) / base["rss"]
    lat_all = [x for v in tally.latency.values() for x in v]
    result = {
        "minutes": args.minutes, "clients": args.clients, "buckets": BUCKETS, "models": list(MODELS),
        "counts": dict(sorted(tally.counts.items())),
        "lost": tally.counts.get("lost", 0), "mixed": tally.counts.get("mixed", 0),
        "latency_s": {m: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99)} for m, v in tally.latency.items()}
        | {"all": {"n": len(lat_all), "p50": pct(lat_all, 0.5), "p99": pct(lat_all, 0.99)}},
        "rss_after_warmup_mib": round(base["rss"] / 2**20, 1),
        "rss_last5min_median_mib": round(statistics.median(s["rss"] for s in tail) / 2**20, 1),
        "rss_growth_after_warmup": round(rss_growth, 4),
        "rss_max_mib": round(max(s["rss"] for s in warm) / 2**20, 1),
        "fds": {"after_warmup": base["fds"], "min": min(s["fds"] for s in warm), "max": max(s["fds"] for s in warm),
                "end": samples[-1]["fds"]},
        "threads": {"after_warmup": base["threads"], "min": min(s["threads"] for s in warm),
                    "max": max(s["threads"] for s in warm), "end": samples[-1]["threads"]},
        "problems": tally.problems, "samples": samples, "machine": machine_info(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "machine")}, indent=1))
    if args.out is not None:
        from onnxdiffusion.folder.artifacts import write_json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out.with_suffix(".json"), result)
        write_md(args.out.with_suffix(".md"), result)


def write_md(path: Path, r: dict) -> None:
    lat = r["latency_s"]
    lines = [
        f"# Soak: {r['minutes']:g} min of mixed load on `serve` (both embedded models, API keys on)",
        "",
        f"CPU: {r['machine'].get('cpu')} ({r['machine'].get('cpus')} cores, shared; load at the end "
        f"{' '.join(r['machine'].get('loadavg') or [])}); commit {r['commit']}; {r['clients']} clients, one worker.",
        "",
        "| measure | value |", "|---|---|",
        f"| answers ok / cancelled / rejected (429, 503) | {r['counts'].get('ok', 0)} / {r['counts'].get('cancelled', 0)} / "
        f"{r['counts'].get('rejected', 0)} |",
        f"| SSE clients that hung up mid-stream | {r['counts'].get('sse_dropped', 0)} |",
        f"| lost / mixed responses | {r['lost']} / {r['mixed']} |",
        f"| sync latency p50 / p99 (s), all | {lat['all']['p50']} / {lat['all']['p99']} (n={lat['all']['n']}) |",
        *[f"| sync latency p50 / p99 (s), {m} | {v['p50']} / {v['p99']} (n={v['n']}) |" for m, v in lat.items() if m != "all"],
        f"| RSS after warm-up -> last 5 min median (MiB) | {r['rss_after_warmup_mib']} -> {r['rss_last5min_median_mib']} "
        f"({100 * r['rss_growth_after_warmup']:+.1f}%) |",
        f"| open FDs after warm-up / min / max / end | {r['fds']['after_warmup']} / {r['fds']['min']} / {r['fds']['max']} / "
        f"{r['fds']['end']} |",
        f"| threads after warm-up / min / max / end | {r['threads']['after_warmup']} / {r['threads']['min']} / "
        f"{r['threads']['max']} / {r['threads']['end']} |",
        "",
        "Acceptance 3 asks RSS growth <= 5% after warm-up, 0 lost / mixed, FD count flat.",
    ]
    if r["problems"]:
        lines += ["", "Problems (first 50):", "", *[f"- {p}" for p in r["problems"]]]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
