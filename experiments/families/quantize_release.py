#!/usr/bin/env python
"""`quantize` at release size without fp32 sessions (issue 43): FLUX.2 [klein] 4B's backbone at its released config
(5 double + 20 single blocks, 3.88 B parameters, 15.5 GB of fp32 weights) with random weights, its text encoder 28
narrow Qwen3 layers at the release width (quantize reads the backbone; the encoder only has to be there).

    python experiments/families/quantize_release.py WORK [--steps build,export,dynamic,static,generate]

Each step is skipped when its output exists (resumable); each command runs under `/usr/bin/time -v` in its own
process (peak RSS = GNU time's "Maximum resident set size", wall = its elapsed time) and its row is merged into
quantize_release.json. Steps:
  build     WORK/klein-src: the diffusers folder, random bf16 shards written tensor by tensor (bench/arch/release.py)
  export    WORK/klein-onnx: `onnxdiffusion export --stream-weights on --skip vae_encoder` (the fp32 ONNX is written
            without building the model); the bf16 shards are deleted once it is complete
  dynamic   WORK/klein-int8d: `onnxdiffusion quantize ... int8-dynamic --no-quality` (latency pair: auto)
  static    WORK/klein-int8s: the same with int8-static, 4 calibration prompts x 4 steps at 512x512
  generate  one 512x512 4-step image from the int8-dynamic folder, `--memory bounded`, 2 threads
  generate-mmap  the same with MALLOC_MMAP_THRESHOLD_=1048576 (glibc's heap: quantize_release.md)
  fp32call  one 256x256 1-step image from the fp32 folder with the sessions quantize's calibration opens for a
            large backbone (unpacked, mapped external data): what int8-static's calibration holds
Before each big write the free disk is checked (>= 15 GB left after it, the brief's margin for the other sessions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "quantize_release.json"
GB = 1e9
MARGIN = 15 * GB


def cli() -> list[str]:
    return [sys.executable, "-m", "onnxdiffusion.cli"]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def need_disk(nbytes: float, what: str) -> None:
    free = shutil.disk_usage("/").free
    if free - nbytes < MARGIN:
        sys.exit(f"{what}: {free / GB:.1f} GB free, {nbytes / GB:.1f} GB to write would leave under "
                 f"{MARGIN / GB:.0f} GB; wait for disk")


def timed(cmd: list[str], log: Path) -> dict:
    """`cmd` under /usr/bin/time -v; its peak RSS, wall and exit status (stderr kept in `log`)."""
    t0 = time.time()
    peaks = {"RssAnon": 0, "RssFile": 0}
    with open(log, "w") as err:
        proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=err, stderr=subprocess.STDOUT)
        while proc.poll() is None:  # the anonymous / file-backed split GNU time does not give (sampled every 2 s)
            for k, v in _child_status(proc.pid).items():
                peaks[k] = max(peaks[k], v)
            time.sleep(2)
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"command": " ".join(["onnxdiffusion" if c == "onnxdiffusion.cli" else c for c in cmd[2:]]),
            "rc": proc.returncode, "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
            "sampled_peak_rss_anon_bytes": peaks["RssAnon"], "sampled_peak_rss_file_bytes": peaks["RssFile"],
            "wall_s": round(time.time() - t0, 1), "load_avg_end": os.getloadavg()}


def _child_status(pid: int) -> dict:
    """RssAnon / RssFile (bytes) of the process /usr/bin/time (pid) runs."""
    try:
        child = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        lines = Path(f"/proc/{child}/status").read_text().splitlines()
    except (OSError, IndexError, ValueError):
        return {}
    return {k: int(v.split()[0]) * 1024 for line in lines for k, _, v in [line.partition(":")]
            if k in ("RssAnon", "RssFile")}


def record(step: str, row: dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data.setdefault("machine", {"cpu": _cpu(), "python": platform.python_version()})
    data.setdefault("rows", {})[step] = row
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(step, json.dumps(row), flush=True)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    have = [f for f in ("avx512_vnni", "avx512_bf16", "amx_tile") if f in flags.split()]
    return f"{name} ({', '.join(have) or 'no avx512_vnni'}), {os.cpu_count()} vCPUs"


def step_build(work: Path) -> None:
    src = work / "klein-src"
    if src.exists() or (work / "klein-onnx").exists():
        return
    need_disk(8.2 * GB, "build")
    from onnxdiffusion.bench.arch.release import build

    t0 = time.time()
    desc = build("flux2_klein", src, depth=None, encoder_layers=28)
    record("build", {"seconds": round(time.time() - t0, 1), "backbone_params": desc["backbone_params"],
                     "backbone_fp32_bytes": 4 * desc["backbone_params"], "src_bytes": folder_bytes(src)})


def step_export(work: Path) -> None:
    src, out = work / "klein-src", work / "klein-onnx"
    if out.exists():
        return
    need_disk(16.5 * GB, "export")
    row = timed([*cli(), "export", str(src), str(out), "--stream-weights", "on", "--skip", "vae_encoder"],
                work / "export.log")
    if row["rc"] == 0:
        row["out_bytes"] = folder_bytes(out)
        row["backbone_bytes"] = folder_bytes(out / "transformer")
        shutil.rmtree(src)
    record("export", row)


def step_quantize(work: Path, recipe: str, name: str, extra: list[str]) -> None:
    out = work / name
    if out.exists():
        return
    need_disk(4.5 * GB if recipe == "int8-dynamic" else 8.5 * GB, recipe)  # static: a spill beside the output
    row = timed([*cli(), "quantize", str(work / "klein-onnx"), str(out), "--recipe", recipe, "--no-quality", *extra],
                work / f"{name}.log")
    if row["rc"] == 0:
        row["out_bytes"] = folder_bytes(out)
        row["backbone_bytes"] = folder_bytes(out / "transformer")
        report = json.loads((out / "quantize_report.json").read_text())
        row["report"] = {k: report.get(k) for k in ("verdict", "latency", "latency_ratio", "pays", "memory",
                                                    "fused_ops", "sizes", "seconds", "quality")}
    record(recipe, row)


def phases(work: Path, folder: str, mode: str, size: int, steps: int, threads: int, name: str,
           png: Path | None = None, env: dict | None = None) -> None:
    """One generation in a fresh process (experiments/families/fullsize_run.py's child: VmHWM per phase, RssAnon /
    RssFile while the backbone is held) under /usr/bin/time -v."""
    if any(r == name for r in (json.loads(RESULTS.read_text()).get("rows", {}) if RESULTS.exists() else {})):
        return
    out = work / f"{name}.json"
    cmd = [sys.executable, str(HERE / "fullsize_run.py"), str(work / folder), "--child", "--modes", mode, "--size",
           str(size), "--steps", str(steps), "--threads", str(threads), *(["--save", str(png)] if png else [])]
    log = work / f"{name}.log"
    t0 = time.time()
    with open(out, "w") as stdout, open(log, "w") as err:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=stdout, stderr=err, env=env)
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    # the child resets VmHWM at each phase (clear_refs), which lowers what GNU time reports too: the peak is the
    # largest phase's
    row = {"folder": folder, "mode": mode, "size": size, "steps": steps, "threads": threads, "rc": proc.returncode,
           "environment": {k: v for k, v in (env or {}).items() if k.startswith("MALLOC_")},
           "gnu_time_max_rss_bytes_after_resets": int(rss.group(1)) * 1024 if rss else None,
           "wall_s": round(time.time() - t0, 1), "load_avg_end": os.getloadavg()}
    lines = out.read_text().strip().splitlines()
    if proc.returncode == 0 and lines:
        row["phases"] = json.loads(lines[-1])
        row["peak_rss_bytes"] = row["phases"]["peak_rss_bytes"]
    record(name, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--steps", default="build,export,dynamic,generate")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    if "build" in steps:
        step_build(args.work)
    if "export" in steps:
        step_export(args.work)
    if "dynamic" in steps:
        step_quantize(args.work, "int8-dynamic", "klein-int8d", [])
    if "static" in steps:
        step_quantize(args.work, "int8-static", "klein-int8s",
                      ["--calib-count", "4", "--calib-steps", "4", "--calib-sampler", "euler"])
    if "generate" in steps:  # the release bench's ours-int8 row's memory
        phases(args.work, "klein-int8d", "bounded", 512, 4, args.threads, "generate int8-dynamic 512x512 4 steps",
               args.work / "klein-int8d-512.png")
    if "generate-mmap" in steps:  # the same with glibc's mmap threshold fixed at 1 MB (quantize_release.md)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
        phases(args.work, "klein-int8d", "bounded", 512, 4, args.threads,
               "generate int8-dynamic 512x512 4 steps, MALLOC_MMAP_THRESHOLD_=1048576",
               args.work / "klein-int8d-512-mmap.png", env)
    if "fp32call" in steps:  # what int8-static's calibration session costs: the fp32 backbone as quantize opens it
        phases(args.work, "klein-onnx", "lean,prepacking=0,arena=0", 256, 1, args.threads,
               "fp32 backbone, calibration's session options, 256x256 1 step")


if __name__ == "__main__":
    main()
