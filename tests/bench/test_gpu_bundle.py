"""bench/gpu_bundle.py keeps one GPU generation's machine code in the CUDA provider and zeroes the rest."""

import importlib.util
import struct
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("gpu_bundle", Path(__file__).parents[2] / "bench" / "gpu_bundle.py")
gpu_bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_bundle)


def entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, sm)
    return bytes(header) + payload


def fake_elf(fatbin: bytes) -> bytearray:
    """A 64-bit ELF with a null section, .nv_fatbin and .shstrtab (all the bundler reads)."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    body_at = 64
    fat_at, names_at = body_at, body_at + len(fatbin)
    shoff = (names_at + len(names) + 7) // 8 * 8
    elf = bytearray(shoff + 3 * 64)
    elf[:4] = b"\x7fELF"
    struct.pack_into("<Q", elf, 0x28, shoff)
    struct.pack_into("<HHH", elf, 0x3A, 64, 3, 2)
    elf[fat_at:fat_at + len(fatbin)] = fatbin
    elf[names_at:names_at + len(names)] = names
    struct.pack_into("<I", elf, shoff + 64, 1)
    struct.pack_into("<QQ", elf, shoff + 64 + 0x18, fat_at, len(fatbin))
    struct.pack_into("<I", elf, shoff + 128, 12)
    struct.pack_into("<QQ", elf, shoff + 128 + 0x18, names_at, len(names))
    return elf


def blob(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", gpu_bundle.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_keeps_only_the_requested_architecture():
    sm80, sm90, ptx = b"\x11" * 40, b"\x22" * 24, b"\x33" * 16
    fat = blob(entry(2, 80, sm80), entry(2, 90, sm90)) + bytes(8) + blob(entry(1, 90, ptx))
    elf = fake_elf(fat)
    seen = gpu_bundle.keep_one_arch(elf, 90)
    assert seen == {80: 40, 90: 24 + 16}
    assert sm90 in elf and sm80 not in elf and ptx not in elf  # PTX would be JIT-compiled: only sm_90 cubins stay
    assert len(elf) == len(fake_elf(fat))  # zeroed in place: offsets in the ELF stay valid


def test_refuses_a_library_without_the_architecture():
    elf = fake_elf(blob(entry(2, 80, b"\x11" * 8)))
    with pytest.raises(SystemExit, match="no sm_90"):
        gpu_bundle.keep_one_arch(elf, 90)
