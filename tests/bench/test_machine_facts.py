"""Every results file names its machine: CPU model, ISA flags, int8 kernel family (faked flags here)."""

from onnxdiffusion.bench import machine
from onnxdiffusion.bench.roofline import to_markdown
from onnxdiffusion.cpu import features


def test_machine_facts_name_the_isa(monkeypatch):
    monkeypatch.setattr(features, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"}))
    f = machine.machine_facts(peaks={"ort_int8": 1987.0})
    assert f["cpu"]["int8_kernels"] == "amx" and f["cpu"]["isa_flags"] == ["avx2", "fma", "avx512f", "avx512_vnni",
                                                                           "amx_tile", "amx_int8"]
    assert f["peaks"] == {"ort_int8": 1987.0} and f["onnxruntime"]
    line = machine.machine_line(f)
    assert "amx_int8" in line and "int8 kernels: amx" in line
    res = {"threads": 1, "batch": 2, "height": 256, "width": 256, "gemm_n": 64, "machine": f,
           "peaks_gflops": {"ort_fp32": 1.0, "ort_int8": 2.0, "numpy_fp32": 3.0},
           "flops_per_call": {"total": 1e9, "by_op": {"Conv": 1e9}}, "variants": {}}
    assert "int8 kernels: amx" in to_markdown(res)
