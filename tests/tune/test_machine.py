"""The report's machine section and why the choice follows from this CPU's kind (tune/machine.py): the CPU, its
VNNI / AMX / bf16 flags, the threads and ONNX Runtime named; each lever's measured speed-ups and runner-up; the
profiles refused; the other kind's expectation."""

from onnxdiffusion.tune.machine import machine_section, session_facts, why_section
from onnxdiffusion.tune.space import Candidate

DEFAULT = Candidate("fp32", "ddim", 20, None, "full", "cpu-fp32")
CHOSEN = Candidate("int8-timestep", "ddim", 12, "deepcache:3:L1", "full", "cpu-int8")
STATIC = Candidate("int8-static", "ddim", 20, None, "full", "cpu-int8")
FEWER = Candidate("fp32", "unipc", 12, None, "full", "cpu-fp32")


def _result(flags, kind, session=True) -> dict:
    timed = [(DEFAULT, 1.0), (CHOSEN, 0.4), (STATIC, 0.6), (FEWER, 0.7)]
    machine = {"cpu": {"model": "Test CPU 9000", "machine": "x86_64", "cores": 8, "isa_flags": flags,
                       "int8_kernels": kind}, "onnxruntime": "1.32.0", "loadavg": [1.0, 2.0, 3.0]}
    if session:
        machine["session"] = {"threads": 8, "providers": ["CPUExecutionProvider"],
                              "threads_how": "ONNX Runtime's default intra-op pool, one per core; tune sets none"}
    return {"machine": machine, "default": DEFAULT.to_dict(), "chosen": CHOSEN.to_dict(),
            "latency_s": {"default": 1.0, "chosen": 0.4},
            "timed": [{**c.to_dict(), "median_s": s} for c, s in timed],
            "runner_up": {"recipe": FEWER.to_dict(), "sampling": STATIC.to_dict(), "cache": STATIC.to_dict(),
                          "decoder": None, "profile": FEWER.to_dict()},
            "unavailable_profiles": {"openvino-int8": "this onnxruntime (1.32.0) has no OpenVINOExecutionProvider"},
            "quantize_builds": [{"recipe": "int8-static", "skipped": "time budget"}]}


def test_the_machine_section_names_the_cpu_its_kernels_threads_and_ort():
    text = "\n".join(machine_section(_result(["avx2", "avx512_vnni", "avx512_bf16"], "vnni")))
    assert "## Machine" in text and "Test CPU 9000, 8 logical cores" in text
    assert "VNNI: yes (avx512_vnni)" in text and "AMX int8: no" in text and "**vnni**" in text
    assert "bf16 | yes (avx512_bf16)" in text and "| threads | 8: ONNX Runtime's default" in text
    assert "1.32.0; providers: CPUExecutionProvider" in text
    amx = "\n".join(machine_section(_result(["avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"], "amx", session=False)))
    assert "AMX int8: yes (amx_int8, amx_tile)" in amx and "**amx**" in amx and "default intra-op pool" in amx


def test_why_gives_each_levers_measured_speedups_the_refused_profiles_and_the_other_kind():
    text = "\n".join(why_section(_result(["avx512_vnni"], "vnni")))
    assert "This CPU's kind: **vnni**" in text
    # the recipe lever alone: int8-static 1/0.6; its runner-up (unipc 12 on fp32) 1/0.7, the chosen 0.7/0.4 faster
    assert "| recipe | int8-timestep | int8-static: 1.67x | fp32, unipc 12 [cpu-fp32]: 1.43x | 1.75x |" in text
    assert "| decoder | full | - | - (none timed within the bound) | - |" in text
    assert "openvino-int8 (this onnxruntime (1.32.0) has no OpenVINOExecutionProvider)" in text
    assert "int8-static (time budget)" in text and "AVX-512 VNNI" in text and "On an AMX Xeon" in text
    amx = "\n".join(why_section(_result(["amx_int8", "amx_tile"], "amx")))
    assert "AMX tiles" in amx and "On a CPU without AMX" in amx


def test_session_facts_name_threads_and_providers():
    s = session_facts()
    assert s["threads"] >= 1 and "CPUExecutionProvider" in s["providers"]


def test_the_other_kind_says_what_tune_builds_for_openvino_int8_and_what_it_did_here():
    text = "\n".join(why_section(_result(["avx512_vnni"], "vnni")))
    assert "also builds int8-static `-O stored=qdq`" in text and "not timed on `openvino-int8`" in text
    assert "Here no folder of another form was planned" in text
    # a run where onnxruntime-openvino was installed: the qdq build's fate, and the choice on openvino-int8 explained
    r = _result(["avx512_vnni", "amx_int8", "amx_tile", "avx512_bf16"], "amx")
    qdq = Candidate("int8-static+stored=qdq", "ddim", 12, None, "full", "openvino-int8")
    r["chosen"] = qdq.to_dict()
    r["timed"].append({**qdq.to_dict(), "median_s": 0.3})
    r["latency_s"]["chosen"] = 0.3
    r["quantize_builds"] = [{"recipe": "int8-static+stored=qdq", "quantize_recipe": "int8-static",
                             "for_profiles": ["openvino-int8"], "profiles": ["openvino-int8"]}]
    amx = "\n".join(why_section(r))
    assert "run by the `openvino-int8` profile (ONNX Runtime's openvino provider)" in amx
    assert "int8 convolutions and linears on AMX tiles" in amx and "On a CPU without AMX" in amx
    assert "Here: int8-static+stored=qdq for openvino-int8: built and searched." in amx
    vnni = "\n".join(why_section({**r, "machine": _result(["avx512_vnni"], "vnni")["machine"]}))
    assert "Here: int8-static+stored=qdq for openvino-int8: built and searched." in vnni
    r["quantize_builds"][0] = {**r["quantize_builds"][0], "skipped": "time budget"}
    assert "for openvino-int8: not built (time budget)" in "\n".join(
        why_section({**r, "machine": _result(["avx512_vnni"], "vnni")["machine"]}))
