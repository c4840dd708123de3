#!/usr/bin/env python
"""Full-size check (not CI): Stable Diffusion v1.5's architecture, random weights, end to end on CPU.

  build     write an SD1.5-shaped diffusers StableDiffusionPipeline folder (seeded random weights)
  export    `onnxdiffusion.export.export_pipeline` on it (validated against PyTorch by the exporter);
            check the >2 GB UNet is model.onnx + ONE external data file and that ONNX Runtime loads it

Generating and timing images at full size is `onnxdiffusion bench --arch sd15` (which builds and exports the
model itself with onnxdiffusion.bench.arch.sd15, and its quantized siblings with --quantize); this script is the
measurement of the export's cost per step (time, peak RSS).

Each phase runs as its own subprocess under `/usr/bin/time -v` (peak RSS); its numbers are merged
into experiments/sd15/sd15_fullsize.json, so phases can be run one at a time and resumed. Everything
runs on ONE thread by default (torch, OpenMP/BLAS, ONNX Runtime intra/inter-op).

  python experiments/sd15/sd15_fullsize.py --phase all [--work /tmp/sd15-bench]   # ~10 GB of disk under --work
  python experiments/sd15/sd15_fullsize.py --phase export                         # rerun just one phase
  python experiments/sd15/sd15_fullsize.py --table                                # print the last results
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

from onnxdiffusion.bench import rss

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = Path(__file__).resolve().parent / "sd15_fullsize.json"
PHASES = ("build", "export")
NEED_DISK_GB = {"build": 5.0, "export": 9.0}

# --- Stable Diffusion v1.5 architecture: the package's (what `bench --arch sd15` builds), at the released
# 512x512 default size as measured here (the package's default is the bench size, 256)
from onnxdiffusion.bench.arch.sd15 import SCHEDULER_CONFIG, TOKENIZER_MAX_LENGTH, configs  # noqa: E402

_CONFIGS = configs()
UNET_CONFIG = {**_CONFIGS["backbone"], "sample_size": 64}
VAE_CONFIG = {**_CONFIGS["vae"], "sample_size": 512}
TEXT_ENCODER_CONFIG = _CONFIGS["text_encoder"]
GiB = 1024**3


class BenchError(Exception):
    """A one-line failure message."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_disk(folder: Path, need_gb: float) -> None:
    free = shutil.disk_usage(folder).free
    if free < need_gb * GiB:
        raise BenchError(f"only {free / GiB:.1f} GiB free under {folder}, this phase needs ~{need_gb:.0f} GiB")


# --- per-process memory ---------------------------------------------------------------------------
_PEAK_BEFORE_RESETS = 0  # VmHWM (and so the ru_maxrss that /usr/bin/time reports) forgets older peaks on reset


def peak_rss_bytes(since_reset: bool = False) -> int | None:
    """Peak RSS of this process; since_reset=True: only since the last reset_peak_rss()."""
    peak = rss.peak_rss_bytes()
    return peak if since_reset else max(peak, _PEAK_BEFORE_RESETS)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a later read is the peak since now."""
    global _PEAK_BEFORE_RESETS
    _PEAK_BEFORE_RESETS = peak_rss_bytes()
    return rss.reset_peak_rss()


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.+)", cpu)
        info["cpu"] = m.group(1).strip() if m else None
        m = re.search(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text())
        info["mem_total_bytes"] = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    return info


# === child side: the phases =======================================================================
def one_thread(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def phase_build(args) -> dict:
    check_disk(args.work, NEED_DISK_GB["build"])
    sys.path.insert(0, str(ROOT / "models" / "training"))
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizer_build import build_tokenizer_files
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from onnxdiffusion.evaluate import scenes

    one_thread(args.threads)
    torch.manual_seed(args.seed)
    target, tmp = args.work / "diffusers", args.work / "diffusers.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    seconds: dict[str, float] = {}

    log("build: tokenizer")
    tok_dir = args.work / "tokenizer_src"
    build_tokenizer_files(scenes.vocabulary(), tok_dir, TOKENIZER_MAX_LENGTH)
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir)
    text_cfg = dict(TEXT_ENCODER_CONFIG)
    text_cfg["vocab_size"] = max(TEXT_ENCODER_CONFIG["vocab_size"], len(tokenizer))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for key, value in ids.items():
        if value is None or not 0 <= value < text_cfg["vocab_size"]:
            raise BenchError(f"tokenizer {key} {value!r} does not fit text-encoder vocab {text_cfg['vocab_size']}")
    text_cfg.update(ids)

    models = {}
    for name, make in (
        ("text_encoder", lambda: CLIPTextModel(CLIPTextConfig(**text_cfg))),
        ("unet", lambda: UNet2DConditionModel(**UNET_CONFIG)),
        ("vae", lambda: AutoencoderKL(**VAE_CONFIG)),
    ):
        log(f"build: {name} (random init, seed {args.seed})")
        t0 = time.perf_counter()
        models[name] = make().eval()
        seconds[f"init_{name}"] = round(time.perf_counter() - t0, 2)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    log("build: parameters " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in params.items()))
    scheduler = PNDMScheduler(**SCHEDULER_CONFIG)
    pipe = StableDiffusionPipeline(
        vae=models["vae"], text_encoder=models["text_encoder"], tokenizer=tokenizer, unet=models["unet"],
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    log(f"build: saving diffusers folder (safetensors) to {target}")
    t0 = time.perf_counter()
    pipe.save_pretrained(tmp, safe_serialization=True)
    seconds["save"] = round(time.perf_counter() - t0, 2)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    sizes = {c: folder_bytes(target / c) for c in ("text_encoder", "unet", "vae", "tokenizer", "scheduler")}
    log(f"build: done, {fmt_bytes(folder_bytes(target))} on disk")
    return {
        "folder": str(target),
        "params": params,
        "params_total": sum(params.values()),
        "text_encoder_vocab_size": text_cfg["vocab_size"],
        "tokenizer_len": len(tokenizer),
        "seconds": seconds,
        "bytes": sizes,
    }


class _ExportProbe:
    """Time (and peak-RSS) each exporter step by wrapping the functions validate.py calls."""

    def __init__(self, threads: int):
        self.threads = threads
        self.current: str | None = None
        self.stats: dict[str, dict] = {}
        self.peak_reset_ok = False

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            rec = self.stats[self.current]
            rec[key] = round(rec.get(key, 0.0) + seconds, 2)

    def timed(self, key: str, fn, label: str):
        def wrapper(*a, **kw):
            if self.current:
                log(f"export: {self.current}: {label}")
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(key, time.perf_counter() - t0)

        return wrapper

    def install(self) -> None:
        import onnx
        import onnxruntime as ort
        import torch

        import onnxdiffusion.export.validate as V

        ort.set_default_logger_severity(3)
        real_session = ort.InferenceSession
        threads = self.threads

        def session(path_or_bytes, sess_options=None, providers=None, **kw):
            if sess_options is None:  # the exporter's validation session: force our thread budget
                sess_options = ort.SessionOptions()
                sess_options.intra_op_num_threads = threads
                sess_options.inter_op_num_threads = 1
            return real_session(path_or_bytes, sess_options=sess_options, providers=providers, **kw)

        ort.InferenceSession = self.timed("ort_load_s", session, "loading into ONNX Runtime, validating")
        torch.onnx.export = self.timed("torch_onnx_export_s", torch.onnx.export, "torch.onnx.export")
        V.consolidate = self.timed("consolidate_s", V.consolidate, "consolidating external data")
        onnx.checker.check_model = self.timed("onnx_checker_s", onnx.checker.check_model, "onnx.checker")
        real_component = V.export_component

        def component(spec, *a, **kw):
            self.current = spec.name
            log(f"export: component {len(self.stats) + 1}/4: {spec.name}")
            self.stats[spec.name] = {}
            self.peak_reset_ok = reset_peak_rss()
            t0 = time.perf_counter()
            try:
                return real_component(spec, *a, **kw)
            finally:
                rec = self.stats[spec.name]
                rec["total_s"] = round(time.perf_counter() - t0, 2)
                known = sum(rec.get(k, 0.0) for k in ("torch_onnx_export_s", "consolidate_s", "onnx_checker_s", "ort_load_s"))
                rec["validate_run_s"] = round(max(0.0, rec["total_s"] - known), 2)
                rec["peak_rss_bytes" if self.peak_reset_ok else "peak_rss_bytes_since_start"] = peak_rss_bytes(
                    since_reset=self.peak_reset_ok)
                log(f"export: {spec.name}: done in {rec['total_s']:.1f} s")
                self.current = None

        V.export_component = component


def _check_unet_folder(out: Path, manifest: dict, threads: int, expect_external: bool = True) -> dict:
    """model.onnx + exactly one external data file (none allowed for --smoke), and ORT loads and runs it."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    folder = out / "unet"
    files = sorted(p.name for p in folder.iterdir())
    onnx_like = [f for f in files if f != "config.json"]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    locations = {ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)}
    listed = manifest["components"]["unet"]["external_data"]
    proto_bytes = (folder / "model.onnx").stat().st_size
    del model
    n_ext = 1 if expect_external else len(locations)
    if len(locations) != n_ext or len(listed) != n_ext or len(onnx_like) != 1 + n_ext or "model.onnx" not in onnx_like:
        raise BenchError(
            f"unet folder should hold model.onnx + ONE external data file, found files {files}, "
            f"graph references {sorted(locations)}, manifest lists {listed}"
        )
    data_file = folder / next(iter(locations)) if locations else None
    log("export: check: loading unet/model.onnx in a fresh ONNX Runtime session and running it once")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    t0 = time.perf_counter()
    try:
        sess = ort.InferenceSession(str(folder / "model.onnx"), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises private types
        raise BenchError(f"ONNX Runtime cannot load {folder / 'model.onnx'}: {str(e).splitlines()[0][:300]}") from None
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    hidden = UNET_CONFIG["cross_attention_dim"]
    feeds = {
        "sample": rng.standard_normal((1, 4, 8, 8), dtype=np.float32),
        "timestep": np.array([500.0], np.float32),
        "encoder_hidden_states": rng.standard_normal((1, TOKENIZER_MAX_LENGTH, hidden), dtype=np.float32),
    }
    t0 = time.perf_counter()
    (y,) = sess.run(["out_sample"], feeds)
    run_s = time.perf_counter() - t0
    if y.shape != (1, 4, 8, 8) or not np.isfinite(y).all():
        raise BenchError(f"unet ONNX output is wrong: shape {y.shape}, finite {bool(np.isfinite(y).all())}")
    del sess
    return {
        "files": files,
        "external_data_file": data_file.name if data_file else None,
        "model_onnx_bytes": proto_bytes,
        "external_data_bytes": data_file.stat().st_size if data_file else 0,
        "ort_load_s": round(load_s, 2),
        "ort_run_8x8_s": round(run_s, 2),
        "ok": True,
    }


def phase_export(args) -> dict:
    src, out = args.work / "diffusers", args.work / "onnx"
    if not (src / "model_index.json").is_file():
        raise BenchError(f"no diffusers folder at {src}; run --phase build first")
    check_disk(args.work, NEED_DISK_GB["export"])
    one_thread(args.threads)
    from onnxdiffusion.export import ExportOptions, export_pipeline

    probe = _ExportProbe(args.threads)
    probe.install()
    log(f"export: {src} -> {out} (opset 17, validation on)")
    t0 = time.perf_counter()
    manifest = export_pipeline(src, out, ExportOptions(overwrite=True), progress=False)
    total_s = time.perf_counter() - t0
    log(f"export: finished in {total_s:.1f} s")
    unet_check = _check_unet_folder(out, manifest, args.threads, expect_external=not args.smoke)
    comps = {}
    for name, info in manifest["components"].items():
        comps[name] = {
            **probe.stats.get(name, {}),
            "bytes": folder_bytes(out / name),
            "external_data": info.get("external_data", []),
            "validation": info.get("validation"),
            "shapes_validated": info.get("shapes_validated"),
        }
    component_s = sum(c.get("total_s", 0.0) for c in comps.values())
    return {
        "folder": str(out),
        "export_pipeline_s": round(total_s, 2),
        "manifest_export_seconds": manifest.get("export_seconds"),
        "load_and_finish_s": round(total_s - component_s, 2),  # loading torch models, tokenizer, hashing
        "components": comps,
        "bytes_total": folder_bytes(out),
        "unet_check": unet_check,
        "tool_versions": manifest.get("tool_versions"),
    }


PHASE_FNS = {"build": phase_build, "export": phase_export}


def child_main(args) -> int:
    """Run one phase in this process; write its record (or a one-line error) for the parent."""
    record_path = args.work / f"phase_{args.phase}.json"
    error_path = args.work / f"phase_{args.phase}.error"
    for p in (record_path, error_path):
        p.unlink(missing_ok=True)

    def fail(msg: str, code: int) -> int:
        msg = " ".join(msg.split())[:500]
        error_path.write_text(msg + "\n")
        print(f"sd15_fullsize: {args.phase}: {msg}", file=sys.stderr, flush=True)
        return code

    t0 = time.perf_counter()
    try:
        from onnxdiffusion.errors import UserError
    except ImportError as e:
        return fail(f"cannot import onnxdiffusion ({e}); run with the project's venv", 2)
    try:
        record = PHASE_FNS[args.phase](args)
    except (BenchError, UserError) as e:
        return fail(str(e), 2)
    except MemoryError:
        return fail(f"out of memory (MemoryError); peak RSS {fmt_bytes(peak_rss_bytes())}", 3)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as e:  # noqa: BLE001 - one line, traceback on --debug
        if args.debug:
            import traceback

            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        return fail(f"{type(e).__name__}: {first} (rerun with --debug for the traceback)", 1)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    record["self_peak_rss_bytes"] = peak_rss_bytes()
    record["peak_rss_was_reset"] = _PEAK_BEFORE_RESETS > 0
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return 0


# === parent side ==================================================================================
def parse_time_v(text: str) -> dict:
    out: dict = {}
    patterns = {
        "max_rss_kb": r"Maximum resident set size \(kbytes\):\s*(\d+)",
        "user_s": r"User time \(seconds\):\s*([\d.]+)",
        "sys_s": r"System time \(seconds\):\s*([\d.]+)",
        "exit_status": r"Exit status:\s*(\d+)",
        "signal": r"Command terminated by signal (\d+)",
    }
    for key, pat in patterns.items():
        m = re.search(pat, text)
        if m:
            out[key] = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    return out


def run_phase(args, phase: str) -> dict:
    """Run one phase as a subprocess under /usr/bin/time -v; returns its merged record or raises BenchError."""
    check_disk(args.work, NEED_DISK_GB[phase])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--phase", phase, "--work", str(args.work),
           "--seed", str(args.seed), "--threads", str(args.threads)]
    cmd += ["--debug"] * args.debug + ["--smoke"] * args.smoke
    time_file = args.work / f"time_{phase}.txt"
    time_file.unlink(missing_ok=True)
    gnu_time = shutil.which("time", path="/usr/bin:/bin")
    if gnu_time:
        cmd = [gnu_time, "-v", "-o", str(time_file), *cmd]
    log(f"=== phase {phase}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
    tv = parse_time_v(time_file.read_text()) if gnu_time and time_file.is_file() else {}
    if tv.get("max_rss_kb"):
        rss, rss_source = tv["max_rss_kb"] * 1024, "/usr/bin/time -v"
    else:
        import resource

        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        rss_source = "getrusage(RUSAGE_CHILDREN) (max over all phases run so far)"
    rc = proc.returncode
    record_path = args.work / f"phase_{phase}.json"
    record = json.loads(record_path.read_text()) if rc == 0 and record_path.is_file() else None
    own = (record or {}).get("self_peak_rss_bytes") or 0
    # The export phase resets VmHWM per component, which also resets what `time` sees.
    if (record or {}).get("peak_rss_was_reset") and own > rss:
        rss, rss_source = own, "child's own VmHWM, kept across per-component resets"
    rc = proc.returncode
    signal_no = tv.get("signal") or (-rc if rc < 0 else None)
    if rc != 0 or signal_no:
        err_file = args.work / f"phase_{phase}.error"
        detail = err_file.read_text().strip() if err_file.is_file() else ""
        if signal_no:
            total = machine_info().get("mem_total_bytes")
            hint = " (SIGKILL: most likely the kernel OOM killer)" if signal_no == 9 else ""
            detail = (f"killed by signal {signal_no}{hint}; peak RSS {fmt_bytes(rss)} of {fmt_bytes(total)} RAM"
                      + (f"; {detail}" if detail else ""))
        raise BenchError(f"phase {phase} failed after {wall:.0f} s (exit {rc}): {detail or 'see the output above'}")
    if record is None:
        raise BenchError(f"phase {phase} exited 0 but wrote no {record_path.name}")
    record["peak_rss_bytes"] = rss
    record["peak_rss_source"] = rss_source
    record["process_wall_s"] = round(wall, 2)
    if tv:
        record["cpu_user_s"], record["cpu_sys_s"] = tv.get("user_s"), tv.get("sys_s")
    log(f"=== phase {phase}: ok in {wall:.0f} s, peak RSS {fmt_bytes(rss)}")
    return record


def load_results(path: Path) -> dict:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            log(f"warning: {path} is not valid JSON; starting a fresh one")
    return {}


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    text = json.dumps(results, indent=2) + "\n"
    work = results.get("work")
    if work and work != "$WORK":  # committed results name no path of the machine they were made on
        text = text.replace(json.dumps(str(work))[1:-1], "$WORK")
    tmp.write_text(text)
    os.replace(tmp, path)


def table(results: dict) -> str:
    lines = []
    ph = results.get("phases", {})
    lines.append("SD1.5 full-size check (random weights), threads=%s" % results.get("threads", "?"))
    lines.append("")
    lines.append(f"{'phase':<10}{'wall':>10}{'peak RSS':>12}  finished")
    for name in PHASES:
        r = ph.get(name)
        if r:
            lines.append(f"{name:<10}{r.get('process_wall_s', 0):>9.0f}s{fmt_bytes(r.get('peak_rss_bytes')):>12}  {r.get('finished', '')}")
        else:
            lines.append(f"{name:<10}{'-':>10}{'-':>12}  (not run)")
    b = ph.get("build")
    if b:
        lines.append("")
        lines.append("params: " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in b["params"].items())
                     + f" (total {b['params_total'] / 1e6:.1f}M); diffusers folder "
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b["bytes"].items() if k in ("unet", "vae", "text_encoder")))
    e = ph.get("export")
    if e:
        lines.append("")
        hdr = f"{'component':<14}{'total s':>9}{'trace+export':>14}{'validate':>10}{'size':>12}{'max abs err':>13}{'max rel err':>13}{'peak RSS':>12}"
        lines.append(hdr)
        for name, c in e["components"].items():
            v = c.get("validation") or {}
            val_s = c.get("ort_load_s", 0) + c.get("validate_run_s", 0)
            rss = c.get("peak_rss_bytes", c.get("peak_rss_bytes_since_start"))
            lines.append(
                f"{name:<14}{c.get('total_s', 0):>9.1f}{c.get('torch_onnx_export_s', 0):>14.1f}{val_s:>10.1f}"
                f"{fmt_bytes(c['bytes']):>12}{v.get('max_abs_error', float('nan')):>13.3g}"
                f"{v.get('max_rel_error', float('nan')):>13.3g}{fmt_bytes(rss):>12}"
            )
        lines.append(f"{'total':<14}{e['export_pipeline_s']:>9.1f}{'':>14}{'':>10}{fmt_bytes(e['bytes_total']):>12}"
                     f"   (incl. {e['load_and_finish_s']:.1f} s loading torch models + hashing)")
        u = e.get("unet_check", {})
        if u:
            lines.append(f"unet folder: {', '.join(u['files'])}; model.onnx {fmt_bytes(u['model_onnx_bytes'])} + "
                         f"{u['external_data_file']} {fmt_bytes(u['external_data_bytes'])}; ORT load {u['ort_load_s']:.1f} s, ok")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=(*PHASES, "all"), default="all",
                    help="all = build, export, generate; finished build/export outputs are reused unless --redo")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sd15-bench"), help="work folder (default /tmp/sd15-bench)")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="results JSON (merged phase by phase)")
    ap.add_argument("--redo", action="store_true", help="with --phase all: rerun build/export even if their output exists")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="threads for torch and ONNX Runtime (default 1)")
    ap.add_argument("--table", action="store_true", help="only print the table from the results JSON")
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny configs of the same block types, to test this script in a minute (results go to --work)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.work = args.work.resolve()
    if args.smoke and args.results == DEFAULT_RESULTS:
        args.results = args.work / "sd15_fullsize_smoke.json"
    return args


def apply_smoke() -> None:
    """Shrink the configs in place (same block types) so the whole script runs in about a minute."""
    UNET_CONFIG.update(block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=8,
                       cross_attention_dim=32, attention_head_dim=4)
    VAE_CONFIG.update(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8)
    TEXT_ENCODER_CONFIG.update(hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2,
                               num_attention_heads=4)
    NEED_DISK_GB.update(build=0.1, export=0.1)


def _done(work: Path, phase: str) -> bool:
    """The phase finished (its record exists), its output is there, and it is newer than what it was made from."""
    outputs = {"build": work / "diffusers" / "model_index.json", "export": work / "onnx" / "manifest.json"}
    record = work / f"phase_{phase}.json"
    if phase not in outputs or not outputs[phase].is_file() or not record.is_file():
        return False
    if phase == "export":
        built = work / "phase_build.json"
        return built.is_file() and record.stat().st_mtime >= built.stat().st_mtime
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    # One thread everywhere; set before numpy/torch/onnxruntime are imported (children inherit it).
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if args.smoke:
        apply_smoke()
    if args.child:
        return child_main(args)
    if args.table:
        if not args.results.is_file():
            print(f"sd15_fullsize: no results at {args.results}", file=sys.stderr)
            return 2
        print(table(load_results(args.results)))
        return 0
    try:
        args.work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"sd15_fullsize: cannot create work folder {args.work}: {e.strerror}", file=sys.stderr)
        return 2
    results = load_results(args.results)
    results.update({
        "what": "SD v1.5 architecture, random weights: build -> onnxdiffusion export"
                + (" [SMOKE: shrunk configs]" if args.smoke else ""),
        "work": str(args.work),
        "threads": args.threads,
        "machine": machine_info(),
        "configs": {"unet": UNET_CONFIG, "vae": VAE_CONFIG, "text_encoder": TEXT_ENCODER_CONFIG,
                    "scheduler": SCHEDULER_CONFIG, "tokenizer_max_length": TOKENIZER_MAX_LENGTH},
    })
    results.setdefault("phases", {})
    todo = PHASES if args.phase == "all" else (args.phase,)
    t0 = time.perf_counter()
    try:
        for phase in todo:
            if args.phase == "all" and not args.redo and _done(args.work, phase):
                log(f"=== phase {phase}: skipped, already done in {args.work} (--redo to rerun)")
                continue
            record = run_phase(args, phase)
            record["command"] = " ".join([Path(sys.executable).name, *sys.argv])
            results["phases"][phase] = record
            if phase == "build":  # a new model invalidates later numbers
                for later in ("export",):
                    if results["phases"].pop(later, None) is not None and later not in todo:
                        log(f"note: dropped stale '{later}' results (the model was rebuilt)")
            save_results(args.results, results)
    except BenchError as e:
        print(f"sd15_fullsize: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sd15_fullsize: interrupted", file=sys.stderr)
        return 130
    log(f"all requested phases done in {time.perf_counter() - t0:.0f} s; results in {args.results}")
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
