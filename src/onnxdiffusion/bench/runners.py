"""Runners: load a variant once, then `generate(prompts, latents)` with per-component timings.

Every runner returns a `Generation` with the same fields, so the bench treats PyTorch, our ONNX
Runtime pipeline and out-of-process peers alike. Timings come from inside the process that ran the
model (a peer measures itself), with the bench's own bookkeeping (copying per-step latents)
subtracted from the step times.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import UserError
from .rss import current_rss_bytes, peak_rss_bytes
from .runner_base import Generation, Job, Runner, _delta, _Timed, _version  # noqa: F401 (re-exported)
from .variants import VariantSpec

PEER_WORKER = Path(__file__).with_name("peer_worker.py")


# --- our ONNX Runtime pipeline ----------------------------------------------------------------------
class _PipelineCache:
    """One loaded Pipeline per model folder, shared by the variants of that folder (fp32 DDIM, DPM++, loops)."""

    def __init__(self, threads: int | None, provider: str, profile: str | None = None, memory: str | None = None):
        self.threads, self.provider, self.profile, self.memory = threads, provider, profile, memory
        self.pipes: dict[Path, tuple[object, dict, dict]] = {}

    def get(self, folder: Path):
        key = Path(folder).resolve()
        if key not in self.pipes:
            from ..folder.artifacts import read_manifest, verify_folder
            from ..runtime import Pipeline

            t0 = time.perf_counter()
            verify_folder(folder, read_manifest(folder))
            verify_s = time.perf_counter() - t0
            rss0 = current_rss_bytes()
            t0 = time.perf_counter()
            pipe = Pipeline.from_folder(folder, provider=self.provider, verify=False, threads=self.threads,
                                        profile=self.profile, memory=self.memory)
            load_s = time.perf_counter() - t0
            sink = {"te": 0.0, "te_end": 0.0, "vae": 0.0, "vae_end": 0.0}
            pipe.encode_prompt = _Timed(pipe.encode_prompt, sink, "te")
            pipe.decode = _Timed(pipe.decode, sink, "vae")
            info = {"verify_s": verify_s, "load_s": load_s, "rss_delta_bytes": _delta(rss0)}
            self.pipes[key] = (pipe, sink, info)
        return self.pipes[key]


class OrtRunner(Runner):
    def __init__(self, spec: VariantSpec, cache: _PipelineCache):
        self.spec, self.cache = spec, cache
        self.pipe = None
        self.load_info: dict = {}

    def load(self) -> dict:
        shared = Path(self.spec.folder).resolve() in self.cache.pipes
        self.pipe, self.sink, base = self.cache.get(self.spec.folder)
        info = dict(base)
        info["shared_pipeline"] = shared
        if self.spec.loop != "host":
            t0 = time.perf_counter()
            self.pipe.sampling_graph(self.spec.loop)
            info["graph_load_s"] = time.perf_counter() - t0
            info["load_s"] = base["load_s"] + info["graph_load_s"]
        self.load_info = info
        return info

    def generate(self, job: Job) -> Generation:
        from ..runtime import GenerationResult

        sink = self.sink
        sink["te"] = sink["vae"] = 0.0
        s = self.spec
        t_start = time.perf_counter()
        c_start = time.process_time()
        events = self.pipe.iter_generate(
            job.prompts, latents=job.latents, steps=s.steps, sampler=s.sampler, guidance=job.guidance,
            batch=len(job.prompts), height=job.height, width=job.width, loop=s.loop,
            **({"decoder": s.decoder} if s.decoder else {}),
        )
        steps: list[float] = []
        steps_cpu: list[float] = []
        lat: list[np.ndarray] = []
        prev = None
        cprev = None
        result = None
        book = 0.0  # our own bookkeeping (copying latents) is not the model's time
        for ev in events:
            now, cnow = time.perf_counter(), time.process_time()
            if isinstance(ev, GenerationResult):
                result = ev
                break
            start = prev if prev is not None else sink["te_end"]
            steps.append(now - start)
            if cprev is not None:  # the first step's CPU start is inside the text encoder's call
                steps_cpu.append(cnow - cprev)
            if job.capture:
                lat.append(np.array(ev.latents, copy=True))
            prev, cprev = time.perf_counter(), time.process_time()
            book += prev - now
        total = time.perf_counter() - t_start
        cpu = time.process_time() - c_start
        host = s.loop == "host"
        sampling = sum(steps) if host else total - sink["te"] - sink["vae"]
        # a host loop's step event is one table row, i.e. one backbone call (samplers/tables.py)
        calls = len(steps) if host else self._table_rows()
        return Generation(
            images=result.images, total_s=total - book, text_encoder_s=sink["te"], sampling_s=sampling,
            vae_s=sink["vae"], step_s=steps if host else None, step_latents=lat if (job.capture and host) else None,
            final_latents=np.array(result.latents, copy=True), cpu_s=cpu, step_cpu_s=steps_cpu if host else None,
            backbone_calls=calls,
        )

    def _table_rows(self) -> int | None:
        """Backbone calls of a loop graph: its sampler table's rows (the graph runs one call a row)."""
        from ..runtime.options import GenerateOptions

        try:
            return self.pipe.table(GenerateOptions(steps=self.spec.steps, sampler=self.spec.sampler)).num_steps
        except (UserError, TypeError, ValueError):
            return None


class PeerError(Exception):
    pass


def peer_env(threads: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return env


def probe_peer(python: Path, peer: str, timeout: float = 120) -> str | None:
    """None if `python` can import the peer's package, else a one-line reason."""
    from .variants import PEER_MODULES

    mod = PEER_MODULES[peer]
    try:
        proc = subprocess.run(
            [str(python), "-c", f"import importlib.util as u, sys; sys.exit(u.find_spec({mod.split('.')[0]!r}) is None "
                                f"or u.find_spec({mod!r}) is None)"],
            capture_output=True, text=True, env=peer_env(1), timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"peer not usable: {python}: {e}"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["module not found"])[-1][:200]
        return f"peer not installed: {python} cannot import {mod} ({tail})"
    return None


class PeerRunner(Runner):
    """A worker process in the peer's venv speaking JSON lines; it times itself and reports its own peak RSS."""

    def __init__(self, spec: VariantSpec, threads: int | None, work: Path, log_path: Path, height: int, width: int,
                 calib_prompts: list[str] | None = None, timeout: float = 3600):
        self.spec, self.threads = spec, threads
        self.work, self.log_path = Path(work).absolute(), Path(log_path).absolute()
        self.height, self.width = height, width
        self.calib_prompts = calib_prompts or []
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.load_info = {}
        self.n = 0
        self.convert: dict | None = None  # the one-off conversion's time and peak RSS, when this load made it
        self.phases: dict[str, int | None] = {}

    def _send(self, msg: dict) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerError(self._died()) from None
        return self._recv()

    def _recv(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(self._died())
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise PeerError(msg.get("message", "peer error"))
        return msg

    def _died(self) -> str:
        rc = self.proc.wait(timeout=30) if self.proc else None
        return f"peer worker exited ({rc}): {self._tail() or 'see ' + str(self.log_path)}"

    def _tail(self) -> str:
        if not self.log_path.is_file():
            return ""
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    def _cmd(self, calib: Path) -> list[str]:
        # the worker runs in its own cache folder (cwd), so every path it gets is absolute (not resolved:
        # a venv's python is a symlink whose target is not the venv)
        from .variants import peer_sampler

        cmd = [str(Path(self.spec.peer_python).absolute()), str(PEER_WORKER), "--backend", self.spec.peer, "--mode", self.spec.peer_mode,
               "--folder", str(Path(self.spec.folder).absolute()), "--cache", str(self.work), "--threads", str(self.threads or 0),
               "--height", str(self.height), "--width", str(self.width), "--calib-prompts", str(calib)]
        own = peer_sampler(self.spec.peer, self.spec.sampler)
        if own is None:  # the plan refuses such a row; a runner made by hand never runs another sampler silently
            raise PeerError(f"the {self.spec.peer} peer cannot run the {self.spec.sampler} sampler")
        if self.spec.decoder == "tiny":  # the source's AutoencoderTiny, converted beside the peer's model
            from .variants import TINY_VAE_DIR

            cmd += ["--tiny-vae", str(Path(self.spec.folder).absolute() / TINY_VAE_DIR)]
        return [*cmd, "--sampler", own]

    def load(self) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        calib = self.work / "calib_prompts.json"
        calib.write_text(json.dumps(self.calib_prompts))
        cmd = self._cmd(calib)
        self.log = open(self.log_path, "w")
        # the one-off conversion (IR / GGUF) in a process of its own: its peak is reported apart, never as the
        # peer's peak, and none of its memory stays in the measured worker
        try:
            conv = subprocess.run([*cmd, "--convert-only"], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=peer_env(self.threads), cwd=self.work, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(f"peer conversion timed out after {self.timeout:.0f} s") from None
        lines = [ln for ln in conv.stdout.splitlines() if ln.startswith("{")]
        rec = json.loads(lines[-1]) if lines else {}
        if conv.returncode != 0 or rec.get("event") != "converted":
            raise PeerError(rec.get("message") or self._tail() or f"peer conversion exited ({conv.returncode})")
        if not rec.get("cached"):
            self.convert = {k: v for k, v in rec.items() if k != "event"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=peer_env(self.threads), cwd=self.work)
        msg = self._recv()
        self.load_info = {k: v for k, v in msg.items() if k != "event"}
        if self.convert is not None:  # what the conversion says of the model (convert_s, quantized_from) as before
            self.load_info["convert"] = self.convert
            for k, v in self.convert.items():
                if k != "peak_rss_bytes":
                    self.load_info.setdefault(k, v)
        return self.load_info

    def reset_peak(self) -> dict:
        """Reset the worker's VmHWM: the next `rss()` is the peak of what ran since (one phase)."""
        return self._send({"cmd": "reset_peak"})

    def phase(self, name: str) -> None:
        """Record the worker's peak RSS since the last reset as phase `name` (load, first, steady), then reset."""
        self.phases[name] = self.rss().get("peak_rss_bytes")
        self.reset_peak()

    def memory(self, method: str) -> dict:
        """The per-phase peaks; the peer's peak is theirs, its one-off conversion's apart under `convert`."""
        peaks = [v for v in self.phases.values() if v]
        out = {"peak_rss_bytes": max(peaks) if peaks else None, "phase_peak_rss_bytes": dict(self.phases),
               "method": method, "baseline_rss_bytes": self.load_info.get("baseline_rss_bytes")}
        if self.convert is not None:
            out["convert"] = self.convert
        return out

    def generate(self, job: Job) -> Generation:
        self.n += 1
        lat_path = self.work / "latents.npy"
        out_path = self.work / "images.npy"
        fin_path = self.work / "final_latents.npy"
        np.save(lat_path, np.ascontiguousarray(job.latents, dtype=np.float32))
        msg = self._send({"cmd": "generate", "prompts": job.prompts, "latents": str(lat_path), "out": str(out_path),
                          "final_latents": str(fin_path), "steps": self.spec.steps, "guidance": job.guidance,
                          "height": job.height, "width": job.width})
        t = msg["timings"]
        return Generation(images=np.load(out_path), total_s=t["total_s"], text_encoder_s=t["text_encoder_s"],
                          sampling_s=sum(t["step_s"]), vae_s=t["vae_s"], step_s=t["step_s"],
                          final_latents=np.load(fin_path) if fin_path.is_file() else None, cpu_s=t.get("cpu_s"),
                          backbone_calls=t.get("backbone_calls"))

    def rss(self) -> dict:
        return self._send({"cmd": "rss"})

    def close(self) -> None:
        if self.proc is None:
            if getattr(self, "log", None) is not None:
                self.log.close()
            return
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()
            self.proc = None


def make_runner(spec: VariantSpec, *, threads: int | None, cache: _PipelineCache | None = None,
                work: Path | None = None, height: int = 64, width: int = 64,
                calib_prompts: list[str] | None = None) -> Runner:
    if spec.kind == "ort":
        return OrtRunner(spec, cache or _PipelineCache(threads, "cpu"))
    if spec.kind == "torch":
        from .torch_runner import TorchRunner

        return TorchRunner(spec, threads)
    if spec.kind == "peer":
        work = Path(work or tempfile.mkdtemp(prefix="bench-peer-"))
        return PeerRunner(spec, threads, work / spec.name, work / f"{spec.name}.log", height, width, calib_prompts)
    raise UserError(f"unknown variant kind {spec.kind!r}")


__all__ = ["Generation", "Job", "Runner", "OrtRunner", "PeerRunner", "PeerError", "make_runner",
           "probe_peer", "peak_rss_bytes"]
