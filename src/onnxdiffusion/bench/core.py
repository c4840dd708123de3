"""`run_bench`: every variant side by side, in one process and one run, fairly.

Order of work (all variants are loaded at once so that repeats can interleave):

1. plan: discover variants (variants.py); unknown names fail here, before anything runs; variants
   that cannot run (missing files, peer not installed, ...) are kept with a reason;
2. load each variant (load time; a failure skips that variant with its reason);
3. first call: one batch-1 generation per variant (cold: first-call time);
4. quality pass: the held-out prompts with fixed per-item seeds, batched, capturing the latents
   after every step on host loops (fidelity, judge accuracy, Frechet distance, error curves);
5. timed repeats: `repeats` rounds, each running every variant once on the same batch-1 job, the
   order rotated every round (this machine's speed drifts; rotation spreads the drift evenly);
6. peak RSS per variant in a fresh child process (memory.py), after the in-process runners are freed;
7. ratios against the reference *of this run*, then results.json / results.csv / plots / report.html.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .. import scenes as S
from ..artifacts import check_external_paths, read_manifest, verify_folder
from ..errors import UserError
from ..paths import default_model_folder
from . import memory
from .assemble import VariantState as _State
from .assemble import assemble, image_sets
from .runners import Generation, Job, PeerError, PeerRunner, _PipelineCache, make_runner, probe_peer
from .variants import PlanOptions, folder_variant, plan_variants, select, source_folder

from .fullsize import ARCHES


@dataclass(frozen=True)
class BenchOptions:
    """Settings of one bench run (None: the default for the model / --arch)."""

    model: Path | None = None
    variants: tuple[str, ...] = ()
    variants_dir: Path | None = None
    steps: int | None = None  # steps of the main sampler (default 20; --arch: fullsize.ARCHES)
    fast_steps: int | None = None  # DPM-Solver++ 2M steps (default steps // 2)
    repeats: int = 5
    prompts: int | None = None  # held-out prompts for the quality columns (default 16; sd15: none)
    batch: int = 8
    guidance: float | None = None  # None: the model's chosen guidance (its eval.json), else 4.0
    size: int | None = None  # image height = width (default: the model's)
    threads: int | None = None  # intra-op threads for every runtime (None: each library's default)
    out: Path = Path("bench-out")
    rss: str = "subprocess"  # subprocess | off
    arch: str | None = None  # None (the given model) | fullsize.ARCHES (random weights, speed/memory/size only)
    work: Path | None = None  # --arch: where the model is built (reused when present)
    progress: bool = True
    judge_path: Path | None = None
    peer_timeout: float = 3600.0
    profile: str | None = None  # hardware profile (name or YAML) for the ONNX Runtime variants
    embed_images: bool = True  # report.html embeds its PNGs (False: links the files beside it)


def _check_out(out: Path, create: bool = True) -> Path:
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise UserError(f"output directory is a file: {out}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"output directory's parent is a file: {parent}")
            break
    if not create:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {out}: {e.strerror}") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output directory is not writable: {out}")
    return out


def _resolve(options: BenchOptions) -> BenchOptions:
    if options.arch is not None and options.arch not in ARCHES:
        raise UserError(f"unknown --arch {options.arch!r}; choose from {', '.join(ARCHES)}")
    full = options.arch is not None
    steps = options.steps if options.steps is not None else (ARCHES[options.arch].steps if full else 20)
    fast = options.fast_steps if options.fast_steps is not None else max(1, steps // 2)
    prompts = options.prompts if options.prompts is not None else (0 if full else 16)
    for name, v, lo in (("steps", steps, 1), ("fast-steps", fast, 1), ("repeats", options.repeats, 1),
                        ("batch", options.batch, 1), ("prompts", prompts, 0)):
        if v < lo:
            raise UserError(f"--{name} must be >= {lo}, got {v}")
    if options.rss not in ("subprocess", "off"):
        raise UserError(f"--rss must be subprocess or off, got {options.rss!r}")
    if options.guidance is not None and (not math.isfinite(options.guidance) or options.guidance < 0):
        raise UserError(f"--guidance must be >= 0, got {options.guidance}")
    if options.threads is not None and options.threads < 1:
        raise UserError(f"--threads must be >= 1, got {options.threads}")
    size = options.size if options.size is not None else (256 if full else None)
    return replace(options, steps=steps, fast_steps=fast, prompts=prompts, size=size)


def _default_guidance(source: Path | None) -> float:
    """The guidance the model was evaluated with (eval.json beside its diffusers folder), else 4.0."""
    import json

    if source is not None:
        try:
            g = json.loads((Path(source) / "eval.json").read_text())["options"]["guidance"]
            if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                return float(g)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return 4.0


def _release_memory() -> None:
    """Give freed model memory back to the OS before the memory probes start their own copies."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _loadavg() -> list[str] | None:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def _is_folder_name(name: str) -> bool:
    """A --variants entry that is a path to a model folder rather than a variant name."""
    return ("/" in name or name.startswith(".")) and Path(name).is_dir()


def machine_info() -> dict:
    import re

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        info["cpu"] = m.group(1).strip() if m else None
        m = re.search(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text())
        info["mem_total_bytes"] = int(m.group(1)) * 1024 if m else None
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    info["numpy"] = np.__version__
    return info


class _Progress:
    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="run", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)

    def step(self, what: str, n: int = 1) -> None:
        self.bar.set_postfix_str(what[:60], refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def run_bench(options: BenchOptions) -> dict:
    """Run the bench; write results.json, results.csv, plots and report.html under options.out.

    Returns the results dict (what results.json holds). Raises UserError on bad input (unknown
    variant, output path that is a file, ...) before any model runs. A failed or interrupted run
    removes what it wrote under options.out (and the folder, if it created it).
    """
    out = Path(options.out).absolute()
    before = set(out.iterdir()) if out.is_dir() else None
    try:
        return _run_bench(options)
    except BaseException:
        if before is None:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():
            for p in set(out.iterdir()) - before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise


def _run_bench(options: BenchOptions) -> dict:
    opts = _resolve(options)
    t_start = time.perf_counter()
    machine = machine_info()  # load average before any model runs
    out = _check_out(opts.out, create=False)  # fail before anything runs; created once the plan is good
    notes: list[str] = []

    sampler = "ddim"
    if opts.arch is not None:
        from ..samplers.config import default_sampler
        from .fullsize import default_work, prepare

        model, source, note = prepare(opts.arch, opts.work or default_work(opts.arch), opts.threads or 1,
                                      progress=opts.progress)
        manifest = read_manifest(model)
        notes.append(note)
        sampler = default_sampler(json.loads((model / "scheduler" / "scheduler_config.json").read_text()))
    else:
        model = Path(opts.model) if opts.model is not None else default_model_folder()
        manifest = read_manifest(model)
        # an untrusted MODEL is refused up front, not reported as a failed row
        verify_folder(model, manifest)
        check_external_paths(model, manifest)
        source = source_folder(model, manifest)
    if opts.variants_dir is not None and not Path(opts.variants_dir).is_dir():
        raise UserError(f"--variants-dir is not a folder: {opts.variants_dir}")
    if opts.guidance is None:
        opts = replace(opts, guidance=_default_guidance(source))
    info = manifest["pipeline"]
    height = width = opts.size or int(info["default_height"])
    if opts.size is None:
        width = int(info["default_width"])
    m = int(info["size_multiple"])
    if height % m or width % m:
        raise UserError(f"--size must be a multiple of {m} for this model, got {height}")

    plan = plan_variants(model, manifest, source, PlanOptions(steps=opts.steps, fast_steps=opts.fast_steps,
                                                              variants_dir=opts.variants_dir, sampler=sampler))
    names = [n.strip() for item in opts.variants for n in item.split(",") if n.strip()]
    if opts.arch and not names:  # full size: the main rows, plus any quantized folder found beside the model
        names = list(ARCHES[opts.arch].variants) + [s.name for s in plan if s.kind == "ort" and s.precision != "fp32"
                                               and s.loop == "host" and s.sampler == "ddim" and not s.hidden]
    extra = [folder_variant(Path(n), model, manifest, opts.steps) for n in names if _is_folder_name(n)]
    names = [n for n in names if not _is_folder_name(n)] + [s.name for s in extra]
    chosen = select(plan + extra, names, opts.variants_dir)
    if opts.arch and not opts.variants:
        notes.append(f"--arch {opts.arch} runs {', '.join(ARCHES[opts.arch].variants)} by default (every variant "
                     "stays loaded so repeats interleave; other rows, e.g. OpenVINO, by --variants).")
    for s in chosen:
        if s.kind == "peer" and s.skip is None:
            s.skip = probe_peer(s.peer_python, s.peer)
    states = [_State(s) for s in chosen]
    active = [st for st in states if st.ok]
    if not active:
        raise UserError("no variant can run: " + "; ".join(f"{st.spec.name}: {st.spec.skip}" for st in states))
    out = _check_out(out)

    quality = opts.arch is None and opts.prompts > 0
    scenes = S.scenes("heldout", max(opts.prompts, 1))
    judge, judge_note = None, None
    if quality:
        if (height, width) != (S.IMAGE_SIZE, S.IMAGE_SIZE):
            judge_note = f"judge columns left out: the judge reads {S.IMAGE_SIZE}x{S.IMAGE_SIZE} images, this run makes {height}x{width}"
        else:
            from ..evaluate.judge import Judge

            try:
                judge = Judge.from_file(opts.judge_path, threads=opts.threads)
            except FileNotFoundError as e:
                judge_note = f"judge columns left out: {e}"
        if judge_note:
            notes.append(judge_note)

    from ..families import get_family

    latent_shape = get_family(manifest.get("family")).latent_shape(info, 1, height, width)[1:]
    from ..evaluate.run import item_latents

    timing_job = Job([scenes[0].caption], item_latents(latent_shape, [0]), opts.guidance, height, width)
    batches = []
    if quality:
        for start in range(0, opts.prompts, opts.batch):
            chunk = scenes[start:start + opts.batch]
            seeds = list(range(start, start + len(chunk)))
            batches.append(Job([sc.caption for sc in chunk], item_latents(latent_shape, seeds), opts.guidance,
                               height, width))

    n_work = len(active) * (2 + len(batches) + opts.repeats + (opts.rss == "subprocess"))
    bar = _Progress(n_work, opts.progress)
    cache = _PipelineCache(opts.threads, "cpu", opts.profile)
    peer_dir = out / "_peers"
    calib = [sc.caption for sc in S.scenes("calib", 16)]
    try:
        # -- 2. load ------------------------------------------------------------------------------
        for st in active:
            try:
                st.runner = make_runner(st.spec, threads=opts.threads, cache=cache, work=peer_dir, height=height,
                                        width=width, calib_prompts=calib)
                st.load = st.runner.load()
            except (UserError, PeerError, OSError, ImportError) as e:
                st.error = f"load failed: {e}"
            except Exception as e:  # noqa: BLE001 - a broken variant must not end the bench
                st.error = f"load failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            bar.step(f"load {st.spec.name}")

        def run(st: _State, job: Job) -> Generation | None:
            if not st.ok:
                return None
            try:
                return st.runner.generate(job)
            except (UserError, PeerError) as e:
                st.error = f"generation failed: {e}"
            except Exception as e:  # noqa: BLE001
                st.error = f"generation failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            return None

        # -- 3. first call --------------------------------------------------------------------------
        for st in active:
            t0 = time.perf_counter()
            g = run(st, timing_job)
            if g is not None:
                st.first_call_s = time.perf_counter() - t0
                if isinstance(st.runner, PeerRunner):
                    st.first_call_s = g.total_s  # measured inside the peer, like its other timings
                    try:
                        st.memory = {**st.runner.rss(), "method": "peer worker's own VmHWM after load + first call",
                                     "baseline_rss_bytes": st.load.get("baseline_rss_bytes")}
                    except PeerError as e:
                        st.memory = {"error": str(e)}
            bar.step(f"first call {st.spec.name}")

        # -- 4. quality pass ------------------------------------------------------------------------
        ref_steps = ("ddim", opts.steps)
        for st in active:
            for job in batches:
                capture = st.spec.host_loop and (st.spec.sampler, st.spec.steps) == ref_steps
                g = run(st, replace(job, capture=capture))
                if g is not None:
                    st.images.append(g.images)
                    if g.final_latents is not None:
                        st.final_latents.append(g.final_latents)
                    if g.step_latents:
                        st.step_latents.append(g.step_latents)
                bar.step(f"quality {st.spec.name}")

        # -- 5. timed repeats, interleaved ------------------------------------------------------------
        for r in range(opts.repeats):
            k = r % len(active)
            for st in active[k:] + active[:k]:
                g = run(st, timing_job)
                if g is not None:
                    st.gens.append(g)
                    if st.timing_images is None:
                        st.timing_images, st.timing_final = g.images, g.final_latents
                bar.step(f"repeat {r + 1}/{opts.repeats} {st.spec.name}")
    finally:
        for st in active:
            if st.runner is not None:
                try:
                    st.runner.close()
                except Exception:  # noqa: BLE001
                    pass
                st.runner = None
        cache.pipes.clear()
        _release_memory()

    # -- 6. peak RSS per variant, each in a fresh process ---------------------------------------------
    if opts.rss == "subprocess":
        for st in active:
            if st.ok and st.spec.kind != "peer":
                spec = st.spec.to_dict()
                if st.spec.loop != "unrolled":
                    spec["steps"] = min(st.spec.steps, 2)
                spec["threads"] = opts.threads
                spec["job"] = {"prompt": timing_job.prompts[0], "latents": timing_job.latents.ravel().tolist(),
                               "shape": list(timing_job.latents.shape), "guidance": opts.guidance,
                               "height": height, "width": width}
                rec = memory.probe(spec)
                st.memory = {**rec, "method": memory.METHOD}
            bar.step(f"memory {st.spec.name}")
    bar.close()

    results = assemble(opts, model, manifest, source, states, scenes, judge, notes, height, width, machine)
    results["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    results["machine"]["loadavg_end"] = _loadavg()
    from .report import write_all

    results["files"] = write_all(out, results, image_sets(states, results), embed=options.embed_images)
    return results


__all__ = ["BenchOptions", "run_bench"]
