"""The load-time check of a folder whose int8 convolutions were laid out for one CPU's kernels.

Runtime side: imports only onnxdiffusion.cpu.features (no onnx). The lowered graph is plain ONNX and
computes the same on any CPU (tests/cpu/test_int8_lowering.py), so a folder built for AMX is never refused:
on a CPU of another int8 kernel family it runs, with one warning that its speed was chosen elsewhere.
"""

from __future__ import annotations

from onnxdiffusion.cpu.features import int8_family


def kernels_warning(record: dict | None, flags: frozenset[str] | None = None) -> str | None:
    """One line when the recorded kernel family differs from this CPU's, else None."""
    if not record or record.get("target") in (None, "any"):
        return None
    here = int8_family(flags)
    if here == record["target"]:
        return None
    built = (record.get("cpu") or {}).get("model", "another CPU")
    return (f"its int8 convolutions were laid out for {record['target']} kernels ({built}) and this CPU has "
            f"{here} kernels: the images are the same, the speed may not be (re-quantize here with -O kernels=auto)")
