"""The report's machine section (the CPU, its int8 and bf16 kernels, the threads, ONNX Runtime) and why the chosen
point won on this CPU kind: what each lever alone and each lever's runner-up measured here, the profiles that ran
and those refused, and what a CPU of the other kind (VNNI vs AMX) changes."""

from __future__ import annotations

import os

from .space import LEVERS, Candidate, changed_levers


def session_facts() -> dict:
    """How tune's sessions run here: ONNX Runtime's default intra-op threads (one per core it may use; tune sets
    none), and the providers this onnxruntime build has."""
    try:
        import onnxruntime

        providers = list(onnxruntime.get_available_providers())
    except ImportError:  # (tune's run time has it; a report written elsewhere may not)
        providers = []
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {"threads": usable, "threads_how": "ONNX Runtime's default intra-op pool, one per core; tune sets none",
            "providers": providers}


def cpu_kind(cpu: dict) -> str:
    """amx | vnni | portable: the int8 kernel family MLAS runs here (cpu/features.int8_family)."""
    return cpu.get("int8_kernels") or "portable"


def _yes(flags: set[str], *names: str) -> str:
    have = [n for n in names if n in flags]
    return f"yes ({', '.join(have)})" if have else "no"


def machine_section(result: dict) -> list[str]:
    m = result["machine"]
    cpu, session = m["cpu"], m.get("session") or {}
    flags = set(cpu.get("isa_flags") or ())
    kind = cpu_kind(cpu)
    threads = (f"{session['threads']}: {session['threads_how']}; one image per timed call" if session
               else "ONNX Runtime's default intra-op pool (one per core)")
    load = m.get("loadavg")
    return ["## Machine", "", "| | |", "|---|---|",
            f"| CPU | {cpu['model']}, {cpu.get('cores')} logical cores ({cpu.get('machine', '-')}) |",
            f"| int8 | AVX-512 / AVX VNNI: {_yes(flags, 'avx512_vnni', 'avx_vnni')}; AMX int8: "
            f"{_yes(flags, 'amx_int8', 'amx_tile')}; ONNX Runtime's int8 kernels here: **{kind}** |",
            f"| bf16 | {_yes(flags, 'avx512_bf16', 'amx_bf16')}; ONNX Runtime's CPU provider has no bf16 kernels (bf16 "
            "runs through the openvino profiles only) |",
            f"| threads | {threads} |",
            f"| ONNX Runtime | {m.get('onnxruntime')}" + (f"; providers: {', '.join(session['providers'])}"
                                                         if session.get("providers") else "") + " |",
            f"| ISA flags read | {' '.join(cpu.get('isa_flags') or ()) or 'none'} |",
            f"| load average at the start | {' / '.join(str(x) for x in load) if load else '-'} |", ""]


def _value(c: Candidate, lever: str) -> str:
    v = c.lever(lever)
    if lever == "sampling":
        return f"{v[0]} {v[1]}"
    return v or "none"


def lever_rows(result: dict) -> list[str]:
    """Per lever: the chosen value, the best timed point moving that lever alone (its speed-up over the default) and
    the runner-up (the fastest timed point within the bound with another value: the chosen's speed-up over it)."""
    timed = {Candidate.from_dict(t): t["median_s"] for t in result["timed"]}
    default, chosen = Candidate.from_dict(result["default"]), Candidate.from_dict(result["chosen"])
    base, mine = result["latency_s"]["default"], result["latency_s"]["chosen"]
    rows = ["| lever | chosen | alone (best timed, vs default) | runner-up (another value) | chosen vs runner-up |",
            "|---|---|---|---|---|"]
    for lever in LEVERS:
        alone = sorted((s, c) for c, s in timed.items() if changed_levers(c, default) == (lever,))
        alone_text = f"{_value(alone[0][1], lever)}: {base / alone[0][0]:.2f}x" if alone else "-"
        r = result["runner_up"].get(lever)
        if r is None:
            runner, ratio = "- (none timed within the bound)", "-"
        else:
            rc = Candidate.from_dict(r)
            s = timed.get(rc)
            runner = f"{rc.label()}: {base / s:.2f}x" if s else rc.label()
            ratio = f"{s / mine:.2f}x" if s else "-"
        rows.append(f"| {lever} | {_value(chosen, lever)} | {alone_text} | {runner} | {ratio} |")
    return rows


def profile_lines(result: dict) -> list[str]:
    """The profiles that ran here (each one's fastest timed point) and those refused, with the reason."""
    timed = [(t["median_s"], Candidate.from_dict(t)) for t in result["timed"]]
    base = result["latency_s"]["default"]
    ran = {}
    for s, c in sorted(timed, key=lambda x: x[0]):
        ran.setdefault(c.profile, (s, c))
    lines = ["- Profiles that ran here: " + "; ".join(f"{p} (fastest timed: {c.label()}, {base / s:.2f}x)"
                                                       for p, (s, c) in ran.items()) + "."]
    refused = result.get("unavailable_profiles") or {}
    lines.append("- Profiles refused here: " + ("; ".join(f"{k} ({v})" for k, v in sorted(refused.items())) or "none")
                 + ".")
    builds = [b for b in result.get("quantize_builds") or () if "skipped" in b or "error" in b]
    if builds:
        lines.append("- Recipes not searched: " + "; ".join(f"{b['recipe']} ({b.get('skipped') or b.get('error')})"
                                                            for b in builds) + ".")
    return lines


def why_section(result: dict) -> list[str]:
    """Why this choice on this CPU kind, from what was measured here, then what the other kind would change."""
    cpu = result["machine"]["cpu"]
    kind = cpu_kind(cpu)
    c = Candidate.from_dict(result["chosen"])
    lines = ["## Why this choice on this CPU", "",
             f"This CPU's kind: **{kind}** ({cpu['model']}). Each lever measured here (medians of the timing above):",
             "", *lever_rows(result), "", *profile_lines(result)]
    provider = _provider(c.profile)
    if c.recipe != "fp32" and provider == "cpu":
        lines.append(f"- The int8 backbone ({c.recipe}) on ONNX Runtime's CPU provider is the fastest point within the "
                     "bound here: its matrix products run on " + {
                         "amx": "AMX tiles (MLAS's QgemmU8S8KernelAmx)",
                         "vnni": "AVX-512 VNNI's u8 x s8 dot products (MLAS's VNNI kernels)"}.get(
                         kind, "MLAS's portable integer kernels") + "; the recipe lever's speed-up in the table is "
                     "what those kernels buy over fp32 on this CPU, and the quantization's error left room for the "
                     "other levers only where the table shows them.")
    elif c.recipe != "fp32":
        lines.append(f"- The int8 backbone ({c.recipe}) run by the `{c.profile}` profile (ONNX Runtime's {provider} "
                     "provider) is the fastest point within the bound here"
                     + (": OpenVINO's CPU plugin runs the whole QDQ graph, its int8 convolutions and linears on "
                        + {"amx": "AMX tiles", "vnni": "AVX-512 VNNI"}.get(kind, "its portable integer kernels")
                        + ", its float parts in bf16 where the CPU has avx512_bf16 / amx_bf16 (the profile's "
                        "float_math)" if provider == "openvino" else "")
                     + "; the recipe and profile levers' speed-ups in the table are what it buys over fp32 here.")
    else:
        lines.append("- No quantized folder beat the fp32 one within the bound here (or none was built in the time "
                     "budget): the picture's error budget went to the sampler, the steps and the cache instead.")
    lines += _other_kind(kind, result)
    return lines


def _provider(profile: str) -> str:
    """The provider a shipped profile runs on ("cpu" for a name this build does not ship: a report read elsewhere)."""
    from ..errors import UserError
    from ..profiles import load_profile

    try:
        return load_profile(profile).provider
    except UserError:
        return "cpu"


def _forms_here(result: dict) -> str:
    """What this run did with the builds of another form a profile declared (builds.py)."""
    forms = [b for b in result.get("quantize_builds") or () if b.get("for_profiles")]
    if not forms:
        return ("Here no folder of another form was planned (no profile available here declares one for the "
                "recipes searched; `openvino-int8` needs onnxruntime-openvino).")
    return "Here: " + "; ".join(
        f"{b['recipe']} for {', '.join(b['for_profiles'])}: " + (
            f"not built ({b.get('skipped') or b.get('error')})" if "skipped" in b or "error" in b else
            "built and searched" if b.get("profiles") else "built, no profile here runs it") for b in forms) + "."


def _other_kind(kind: str, result: dict) -> list[str]:
    if kind == "amx":
        return ["- On a CPU without AMX (AVX-512 VNNI, e.g. AMD EPYC) ORT's own int8 kernels lead and OpenVINO's "
                "bf16 has no tiles to run on: there the choice is expected on cpu-int8 (with onnxruntime-openvino "
                "installed, `tune` still builds and times the `-O stored=qdq` folder there, and the timing decides) "
                "and the same lever search applies (experiments/tune/README.md, rounds 3-4). " + _forms_here(result)]
    return ["- On an AMX Xeon (Sapphire Rapids and later; flags amx_tile amx_int8 amx_bf16) with onnxruntime-openvino "
            "installed, `tune` also builds int8-static `-O stored=qdq`, the form the `openvino-int8` profile declares "
            "(standard ONNX operators only, the attention written out, so OpenVINO runs the whole graph: int8 "
            "convolutions and linears on AMX tiles, bf16 float parts, static backbone shapes), as a folder of its own "
            "(cached by content hash) right after int8-static's CPU-fused one, where the budget allows and that one "
            "did not miss the bound at the folder's own sampler and steps, and searches and times it on "
            "`openvino-int8` only; the CPU-fused int8 folders are not timed on `openvino-int8` (OpenVINO would run "
            "them split around ONNX Runtime's own operators). The expected choice there, where its picture keeps the "
            "bound, is that folder on `openvino-int8`: experiments/amx measured its backbone step 1.72x ORT CPU's int8-static (0.46 vs 0.79 s, "
            "SD1.5 size, 1 thread; 2.25x diffusers bf16 end to end vs 1.08-1.24x for ORT's int8) at -0.41 / -0.13 dB "
            "vs int8-static on the embedded models (64 prompts), not a tune run. Why: ORT's CPU provider has no bf16 "
            "kernels, and its QLinearConv with constant zero points runs the VNNI kernel, not AMX. With the default "
            "`--recipes` it is the third build (after int8-timestep and int8-static), which a 20-minute budget may "
            "not reach; `--recipes int8-static` makes it the second. " + _forms_here(result) + " The quality levers "
            "are CPU-independent and carry over, and the PSNR floor and paired test are read again from that "
            "machine's own pictures. experiments/tune/other_cpu.sh runs the four acceptance runs on such a machine."]
