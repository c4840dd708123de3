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
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ..evaluate import scenes as S
from ..folder.artifacts import check_external_paths, read_manifest, verify_folder
from ..errors import UserError
from ..folder.paths import default_model_folder, shown_path
from . import memory
from .assemble import VariantState as _State
from .options import BenchOptions  # noqa: F401 - re-exported: bench.BenchOptions
from .assemble import assemble, image_sets
from .runners import Generation, Job, PeerError, PeerRunner, _PipelineCache, make_runner, probe_peer
from .variants import (PlanOptions, folder_variant, plan_variants, select, source_folder,
                       tiny_skip)

from .arch import ARCHES
from .setup import (_check_out, _default_guidance, _is_folder_name, _loadavg, _Progress, _release_memory, _resolve,
                    machine_info, recommended)


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


PEER_METHOD = ("the peer worker's own VmHWM per phase (load; first call; timed repeats), reset between them; its "
               "one-off conversion in a process of its own, apart")


def _run_bench(options: BenchOptions) -> dict:
    rec = {} if options.arch is not None else recommended(read_manifest(Path(options.model) if options.model is not None
                                                                     else default_model_folder()))
    opts = _resolve(options, rec)
    t_start = time.perf_counter()
    machine = machine_info()  # load average before any model runs
    out = _check_out(opts.out, create=False)  # fail before anything runs; created once the plan is good
    notes: list[str] = []
    model, manifest, source, sampler, work = _model(opts, rec, notes)
    if opts.guidance is None:
        arch_guidance = ARCHES[opts.arch].guidance if opts.arch else None
        opts = replace(opts, guidance=arch_guidance if arch_guidance is not None else _default_guidance(source, rec))
    info = manifest.pipeline
    height = width = opts.size or int(info.default_height)
    if opts.size is None:
        width = int(info.default_width)
    m = int(info.size_multiple)
    if height % m or width % m:
        raise UserError(f"--size must be a multiple of {m} for this model, got {height}")
    quantized = _quantized(opts, model, work, notes)
    states = _plan(opts, model, manifest, source, sampler, quantized, notes)
    active = [st for st in states if st.ok]
    if not active:
        raise UserError("no variant can run: " + "; ".join(f"{st.spec.name}: {st.spec.skip}" for st in states))
    out = _check_out(out)

    quality = opts.arch is None and opts.prompts > 0 and not opts.isolate
    if opts.isolate and opts.arch is None and opts.prompts > 0:
        notes.append("--isolate measures speed and memory only: the quality columns are left out (run without "
                     "--isolate for them).")
    scenes = S.scenes("heldout", max(opts.prompts, 1))
    judge = _judge(opts, height, width, notes) if quality else None

    from ..evaluate.run import item_latents
    from ..families import get_family

    latent_shape = get_family(manifest.family).latent_shape(info, 1, height, width)[1:]
    timing_job = Job([scenes[0].caption], item_latents(latent_shape, [0]), opts.guidance, height, width)
    batches = []
    if quality:
        for start in range(0, opts.prompts, opts.batch):
            chunk = scenes[start:start + opts.batch]
            seeds = list(range(start, start + len(chunk)))
            batches.append(Job([sc.caption for sc in chunk], item_latents(latent_shape, seeds), opts.guidance,
                               height, width))
    calib = [sc.caption for sc in S.scenes("calib", 16)]
    if opts.isolate:
        from .isolate import run_isolated

        bar = _Progress(len(active) * opts.repeats, opts.progress)
        peer_dir = work / "peers" if work is not None else out / "_peers"
        run_isolated(active, timing_job, opts.repeats, opts.threads, opts.profile, opts.memory, out / "_isolate",
                     peer_dir, calib, bar.step)
        shutil.rmtree(out / "_isolate", ignore_errors=True)
        bar.close()
    else:
        _measure_in_process(opts, active, timing_job, batches, (sampler, opts.steps), out / "_peers", calib)

    results = assemble(opts, model, manifest, source, states, scenes, judge, notes, height, width, machine)
    results["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    results["machine"]["loadavg_end"] = _loadavg()
    if quantized:
        results["quantized"] = quantized[1]
    from .report import write_all

    results["files"] = write_all(out, results, image_sets(states, results), embed=options.embed_images)
    return results


def _model(opts, rec: dict, notes: list[str]):
    """(model folder, manifest, diffusers source, main sampler, work folder or None): --arch's, built if needed,
    else the given (or embedded) model, verified."""
    sampler = rec.get("sampler")  # the model's own: its manifest's recommended sampler, else its scheduler's
    from ..samplers.config import default_sampler

    if opts.arch is not None:
        from .arch import default_work, prepare

        work = Path(opts.work or default_work(opts.arch)).resolve()
        model, source, note = prepare(opts.arch, work, opts.threads or 1, progress=opts.progress, depth=opts.arch_depth)
        notes.append(note)
        sampler = opts.sampler or ARCHES[opts.arch].sampler or default_sampler(
            json.loads((model / "scheduler" / "scheduler_config.json").read_text()))
        notes.append(_sampler_note(sampler, opts.steps, "--sampler" if opts.sampler else f"--arch {opts.arch}'s"))
        return model, read_manifest(model), source, sampler, work
    model = Path(opts.model) if opts.model is not None else default_model_folder()
    manifest = read_manifest(model)
    # an untrusted MODEL is refused up front, not reported as a failed row
    verify_folder(model, manifest)
    check_external_paths(model, manifest)
    source = source_folder(model, manifest)
    if opts.sampler is not None:
        sampler = opts.sampler
    elif sampler is None:
        sched = model / "scheduler" / "scheduler_config.json"
        sampler = default_sampler(json.loads(sched.read_text())) if sched.is_file() else "ddim"
    notes.append(_sampler_note(sampler, opts.steps, "--sampler" if opts.sampler else "the model's own"))
    return model, manifest, source, sampler, (Path(opts.work).resolve() if opts.work is not None else None)


def _sampler_note(sampler: str, steps: int, why: str) -> str:
    return (f"every row runs {sampler} {steps} ({why}; peers too, or they are refused), except rows named *-dpmpp "
            f"(DPM-Solver++ 2M at --fast-steps); the backbone-call column counts each row's UNet/transformer calls.")


def _quantized(opts, model: Path, work: Path | None, notes: list[str]) -> tuple[list[Path], list[dict]] | None:
    """--quantize: the quantized siblings, built (or found in the cache) before anything is measured."""
    if not opts.quantize:
        return None
    from .quantized import build_siblings, default_cache

    args = ARCHES[opts.arch].quantize_args if opts.arch else ()
    folders, records = build_siblings(model, opts.quantize, default_cache(work), args, opts.threads, opts.progress)
    made = ", ".join(r["recipe"] + (": cached" if r["cached"] else f": built in {r['seconds']:.0f} s") for r in records)
    notes.append(f"--quantize {made} (onnxdiffusion quantize {' '.join(args)}; cache {shown_path(default_cache(work))}).")
    return folders, records


def _plan(opts, model: Path, manifest: dict, source, sampler: str, quantized, notes: list[str]) -> list[_State]:
    if opts.variants_dir is not None and not Path(opts.variants_dir).is_dir():
        raise UserError(f"--variants-dir is not a folder: {opts.variants_dir}")
    plan = plan_variants(model, manifest, source, PlanOptions(
        steps=opts.steps, fast_steps=opts.fast_steps, variants_dir=opts.variants_dir, sampler=sampler,
        decoder=opts.decoder,
        quantized=tuple(quantized[0]) if quantized else None))
    names = [n.strip() for item in opts.variants for n in item.split(",") if n.strip()]
    if opts.arch and not names:  # full size: the main rows, plus any quantized folder found beside the model
        names = list(ARCHES[opts.arch].variants) + [s.name for s in plan if s.kind == "ort" and s.precision != "fp32"
                                               and s.loop == "host" and s.sampler == sampler and not s.hidden]
    extra = [folder_variant(Path(n), model, manifest, opts.steps, sampler) for n in names if _is_folder_name(n)]
    for s in extra if opts.decoder else ():  # the decoder every other row runs
        s.decoder, s.label, s.skip = opts.decoder, s.label + " + tiny decoder", s.skip or tiny_skip(s)
    names = [n for n in names if not _is_folder_name(n)] + [s.name for s in extra]
    chosen = select(plan + extra, names, opts.variants_dir)
    if opts.arch and not opts.variants:
        notes.append(f"--arch {opts.arch} runs {', '.join(ARCHES[opts.arch].variants)} by default (every variant "
                     "stays loaded so repeats interleave; other rows, e.g. OpenVINO, by --variants).")
    named = {n.strip() for item in opts.variants for n in item.split(",")}
    for s in chosen:
        if s.sampler_refusal and s.name in named:  # asked for by name: refused before anything runs, never a
            raise UserError(f"{s.name}: {s.sampler_refusal}")  # silent other sampler
        if s.kind == "peer" and s.skip is None:
            s.skip = probe_peer(s.peer_python, s.peer)
    return [_State(s) for s in chosen]


def _judge(opts, height: int, width: int, notes: list[str]):
    judge, judge_note = None, None
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
    return judge


def _measure_in_process(opts, active: list[_State], timing_job: Job, batches: list[Job], ref_steps: tuple,
                        peer_dir: Path, calib: list[str]) -> None:
    """Steps 2-6 of the module docstring: every variant loaded at once, first call, quality pass, timed repeats
    interleaved, then each variant's peak RSS in a fresh process."""
    height, width = timing_job.height, timing_job.width
    n_work = len(active) * (2 + len(batches) + opts.repeats + (opts.rss == "subprocess"))
    bar = _Progress(n_work, opts.progress)
    cache = _PipelineCache(opts.threads, "cpu", opts.profile, opts.memory)
    try:
        # -- 2. load ------------------------------------------------------------------------------
        for st in active:
            try:
                st.runner = make_runner(st.spec, threads=opts.threads, cache=cache, work=peer_dir, height=height,
                                        width=width, calib_prompts=calib)
                st.load = st.runner.load()
                if isinstance(st.runner, PeerRunner):
                    st.runner.phase("load")
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
                        st.runner.phase("first")
                    except PeerError as e:
                        st.memory = {"error": str(e)}
            bar.step(f"first call {st.spec.name}")

        # -- 4. quality pass ------------------------------------------------------------------------
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
        for st in active:  # the steady phase's peak: the repeats only, not the quality pass's batches
            if st.ok and isinstance(st.runner, PeerRunner):
                st.runner.reset_peak()
        for r in range(opts.repeats):
            k = r % len(active)
            for st in active[k:] + active[:k]:
                g = run(st, timing_job)
                if g is not None:
                    st.gens.append(g)
                    if st.timing_images is None:
                        st.timing_images, st.timing_final = g.images, g.final_latents
                bar.step(f"repeat {r + 1}/{opts.repeats} {st.spec.name}")
        for st in active:
            if st.ok and isinstance(st.runner, PeerRunner):
                try:
                    st.runner.phase("steady")
                    st.memory = st.runner.memory(PEER_METHOD)
                except PeerError as e:
                    st.memory = {"error": str(e)}
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



__all__ = ["BenchOptions", "run_bench"]
