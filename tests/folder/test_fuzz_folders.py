"""A small sample of bench/fuzz_folders.py: crafted model folders through every loader, in a worker
subprocess under a timeout; each must end clean (loaded, or refused with one UserError): no traceback,
signal or hang. The seeds include every case the full run found before the loader's checks refused them."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# found by the full run (tracebacks inside ONNX Runtime), now refused by the loader: keep them refused
FOUND = [227, 324, 333, 547, 650, 678, 710, 1763]
FOUND_QUANTIZE = [60, 180, 420, 440, 1500, 100340]  # quantize's open stage hit them (reshape of a crafted initializer, duplicate node, opset conversion, truncated tensor, IR version 0)
SAMPLE = list(range(20000, 20012))


def _fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_folders", ROOT / "bench" / "fuzz_folders.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_folders"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_crafted_folders_end_clean(tmp_path):
    fz = _fuzz()
    worker = fz.Worker()
    bad = []
    try:
        for seed in FOUND + FOUND_QUANTIZE + SAMPLE:
            base = sorted(fz.BASES)[seed % len(fz.BASES)]
            case = tmp_path / f"case-{seed}"
            info = fz.craft(fz.BASES[base], case, seed)
            res = worker.ask({"folder": str(case), "quantize": seed in FOUND_QUANTIZE or seed == SAMPLE[0]}, 180)
            outcome = fz.classify(res)
            if outcome != "clean":
                bad.append((seed, info["what"], res))
                worker = fz.Worker()
            shutil.rmtree(case, ignore_errors=True)
    finally:
        worker.close()
    assert bad == []


def test_crafting_never_writes_through_to_the_embedded_models(tmp_path):
    """Cases are hard links of the embedded folders: a crafted file must be a new inode."""
    fz = _fuzz()
    from onnxdiffusion.folder.artifacts import read_manifest, verify_folder

    for seed in range(30000, 30030):
        base = sorted(fz.BASES)[seed % len(fz.BASES)]
        fz.craft(fz.BASES[base], tmp_path / f"c{seed}", seed)
    for folder in fz.BASES.values():
        verify_folder(folder, read_manifest(folder))
    pytest.importorskip("onnx")


def test_crafted_lora_files_end_clean(tmp_path):
    """bench/fuzz_folders.py --kind adapters: crafted LoRA files through the run-time adapter loader."""
    fz = _fuzz()
    sys.path.insert(0, str(ROOT / "bench"))
    import fuzz_adapters

    points = fuzz_adapters.points_folders(fz.BASES, tmp_path)
    worker = fz.Worker()
    bad = []
    try:
        for seed in range(40000, 40024):
            base = sorted(fz.BASES)[seed % len(fz.BASES)]
            case = tmp_path / f"case-{seed}.safetensors"
            info = fuzz_adapters.craft(points[base], case, seed)
            res = worker.ask({"folder": str(points[base]), "lora": str(case), "scale": info.pop("_scale")}, 180)
            if fz.classify(res) != "clean":
                bad.append((seed, info["what"], res))
                worker = fz.Worker()
    finally:
        worker.close()
    assert bad == []
