"""Where a result was measured: one dict every bench / roofline / experiment results file carries.

CPU model, the ISA flags that decide the int8 and bf16 kernels (onnxdiffusion.cpu.features), cores,
the load when measured, and the ONNX Runtime / numpy versions. Results without these cannot be
compared across sessions: the machines differ (AVX-512 VNNI only, or AMX).
"""

from __future__ import annotations

import platform
from pathlib import Path

from onnxdiffusion.cpu.features import isa_summary


def machine_facts(peaks: dict | None = None) -> dict:
    """`peaks`: the roofline's measured GEMM peaks, when the caller has them (GOP/s, GFLOP/s)."""
    import numpy

    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:  # a peer's venv may lack it
        ort_version = None
    try:
        load = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        load = None
    facts = {"cpu": isa_summary(), "loadavg": load, "onnxruntime": ort_version, "numpy": numpy.__version__,
             "python": platform.python_version()}
    if peaks:
        facts["peaks"] = peaks
    return facts


def machine_line(facts: dict) -> str:
    """One markdown line naming the machine (for reports)."""
    c = facts["cpu"]
    return (f"{c['model']}, {c['cores']} cores, ISA: {' '.join(c['isa_flags']) or 'n/a'} (int8 kernels: {c['int8_kernels']}); "
            f"onnxruntime {facts.get('onnxruntime')}; load {facts.get('loadavg')}")
