"""Pack onnxruntime-gpu for a GPU machine that has no network and takes files in small pieces.

    python bench/gpu_bundle.py WHEEL --arch 90 --out .gpu

The CUDA provider's shared library carries machine code for six GPU generations (sm_75 ... sm_120,
~210 MiB of fat binaries); a lent H200 runs only sm_90's. The other generations' cubin payloads are
zeroed in place (the fat-binary headers stay, so the driver still parses the section and picks sm_90),
which lets xz shrink the library from 284 MB to ~50 MB. Two parts come out so that each fits a
64 MiB transfer beside the repo: `ort-cuda.tar.xz` (the CUDA provider) and `ort-core.tar.xz` (the
Python package, its pybind module and the provider bridge). `bench/gpu_check.sh` unpacks them when
`ORT_GPU_BUNDLE` names the folder. TensorRT's libraries (> 1 GB) cannot travel this way.
"""

from __future__ import annotations

import argparse
import io
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
CUBIN = 2


def fatbin_section(elf: bytes) -> tuple[int, int]:
    """(offset, size) of the .nv_fatbin section, read from the ELF section headers."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    names_off, = struct.unpack_from("<Q", elf, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        name_at, = struct.unpack_from("<I", elf, h)
        end = elf.index(b"\0", names_off + name_at)
        if elf[names_off + name_at:end] == b".nv_fatbin":
            off, size = struct.unpack_from("<QQ", elf, h + 0x18)
            return off, size
    raise SystemExit("gpu_bundle: no .nv_fatbin section in the CUDA provider")


def keep_one_arch(elf: bytearray, arch: int) -> dict[int, int]:
    """Zero every cubin payload not built for `arch`; returns bytes per arch found."""
    off, size = fatbin_section(bytes(elf))
    pos, end, seen = off, off + size, {}
    while pos < end:
        magic, _, header, fat = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned; padding sits between them
            continue
        p, stop = pos + header, pos + header + fat
        while p < stop:
            kind, _, ehs, payload = struct.unpack_from("<HHIQ", elf, p)
            sm, = struct.unpack_from("<I", elf, p + 28)
            seen[sm] = seen.get(sm, 0) + payload
            if kind != CUBIN or sm != arch:
                elf[p + ehs:p + ehs + payload] = bytes(payload)
            p += ehs + payload
        pos = stop
    if arch not in seen:
        raise SystemExit(f"gpu_bundle: no sm_{arch} code in the CUDA provider (has {sorted(seen)})")
    return seen


def pack(members: dict[str, bytes], out: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".so") or ".so." in name else 0o644
            tar.addfile(info, io.BytesIO(data))
    # xz, not zstd: the target's Python unpacks it with the standard library alone (tarfile + lzma)
    with open(out, "wb") as f:
        subprocess.run(["xz", "-9e", "-T0", "-c"], input=buf.getvalue(), stdout=f, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="an onnxruntime-gpu wheel for the target's Python (pip download)")
    ap.add_argument("--arch", type=int, default=90, help="the SM generation to keep (H100/H200: 90)")
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    a = ap.parse_args()
    cuda, core = {}, {}
    with zipfile.ZipFile(a.wheel) as z:
        for name in z.namelist():
            if name.endswith("/"):
                continue  # directory entries would unpack as empty files and shadow the folders
            if name.endswith(("libonnxruntime_providers_tensorrt.so",)) or ".so.1." in name:
                continue  # TensorRT's bridge needs TensorRT's libraries; libonnxruntime.so is the C API only
            if name.endswith("libonnxruntime_providers_cuda.so"):
                elf = bytearray(z.read(name))
                seen = keep_one_arch(elf, a.arch)
                print("fat binaries (MiB):", {f"sm_{k}": round(v / 2**20, 1) for k, v in sorted(seen.items())})
                cuda[name] = bytes(elf)
            elif name.startswith("onnxruntime/") and "/test" not in name:
                core[name] = z.read(name)
    a.out.mkdir(parents=True, exist_ok=True)
    for part, members in (("ort-cuda", cuda), ("ort-core", core)):
        pack(members, a.out / f"{part}.tar.xz")
        print(f"{part}: {(a.out / f'{part}.tar.xz').stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
