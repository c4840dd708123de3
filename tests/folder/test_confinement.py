"""Untrusted model folders: every verb, hostile manifests and ONNX files (`..`, absolute paths, symlinks,
sparse-tensor external data). Afterwards no file outside OUT has changed (a snapshot of the scratch tree)
and no file outside the model folder was opened (builtins.open / io.open / os.open / os.link hooked)."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from pathlib import Path

import onnx
import pytest

from cli_helpers import invoke

from onnxdiffusion.folder.artifacts import hash_tree, sha256_file


def _rehash(model: Path) -> None:
    m = json.loads((model / "manifest.json").read_text())
    m["files"] = hash_tree(model)
    (model / "manifest.json").write_text(json.dumps(m))


def _edit_manifest(model: Path, fn) -> None:
    m = json.loads((model / "manifest.json").read_text())
    fn(m)
    (model / "manifest.json").write_text(json.dumps(m))


def _external(model: Path, rel: str, location: str, sparse: bool) -> None:
    p = model / rel
    m = onnx.load(str(p))
    if sparse:
        sp = m.graph.sparse_initializer.add()
        sp.dims.extend([4])
        t = sp.values
        t.name, t.data_type = "hostile_values", onnx.TensorProto.FLOAT
        t.dims.extend([1])
        sp.indices.name, sp.indices.data_type = "hostile_indices", onnx.TensorProto.INT64
        sp.indices.dims.extend([1])
        sp.indices.int64_data.extend([0])
    else:
        t = m.graph.initializer[0]
        t.ClearField("raw_data")
        t.ClearField("float_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "4")):
        e = t.external_data.add()
        e.key, e.value = k, v
    onnx.save(m, str(p))
    _rehash(model)


def _symlink_out(model: Path, rel: str, scratch: Path) -> None:
    outside = scratch / "outside" / rel
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / rel, outside)
    (model / rel).unlink()
    (model / rel).symlink_to(outside)


def _dir_symlink_out(model: Path, rel: str, scratch: Path) -> None:
    outside = scratch / "outside" / rel
    shutil.copytree(model / rel, outside)
    shutil.rmtree(model / rel)
    (model / rel).symlink_to(outside, target_is_directory=True)


HOSTILE = {
    # a files key leaving the folder, with the victim's real hash (only confinement stops it)
    "files-key-dotdot": lambda m, s: _edit_manifest(m, lambda d: d["files"].__setitem__(
        "../victim.txt", sha256_file(s / "victim.txt"))),
    "files-key-absolute": lambda m, s: _edit_manifest(m, lambda d: d["files"].__setitem__(
        str(s / "victim.txt"), sha256_file(s / "victim.txt"))),
    "component-dotdot": lambda m, s: (shutil.copytree(m / "unet", s / "outside_unet"), _edit_manifest(
        m, lambda d: (d["components"]["unet"].__setitem__("path", "../outside_unet/model.onnx"),
                      d["files"].__setitem__("../outside_unet/model.onnx", d["files"]["unet/model.onnx"])))),
    "component-absolute": lambda m, s: (shutil.copytree(m / "unet", s / "outside_unet"), _edit_manifest(
        m, lambda d: d["components"]["unet"].__setitem__("path", str(s / "outside_unet" / "model.onnx")))),
    "component-symlink": lambda m, s: _symlink_out(m, "unet/model.onnx", s),
    "tokenizer-symlink": lambda m, s: _dir_symlink_out(m, "tokenizer", s),
    "scheduler-symlink": lambda m, s: _symlink_out(m, "scheduler/scheduler_config.json", s),
    "external-dotdot": lambda m, s: _external(m, "unet/model.onnx", "../../secret.bin", sparse=False),
    "external-absolute": lambda m, s: _external(m, "vae_decoder/model.onnx", str(s / "secret.bin"), sparse=False),
    "external-sparse": lambda m, s: _external(m, "text_encoder/model.onnx", "../../secret.bin", sparse=True),
    "no-hash-list": lambda m, s: _edit_manifest(m, lambda d: d.pop("files")),
}

VERBS = {
    "generate": lambda m, out: ["generate", m, "a red circle", "--steps", "2", "-o", out / "x.png"],
    "quantize": lambda m, out: ["quantize", m, out / "q", "--recipe", "int8-dynamic"],
    "compile-loop": lambda m, out: ["compile-loop", m, out / "l"],
    "export-web": lambda m, out: ["export-web", m, out / "w"],
    "evaluate": lambda m, out: ["evaluate", m, "--count", "2", "--batch", "2", "--steps", "2", "-o", out / "e.json"],
    "bench": lambda m, out: ["bench", m, "--variants", "ort-fp32", "--rss", "off", "--prompts", "0", "--repeats", "1",
                             "--out", out / "b", "--quiet"],
}


class OpenLog:
    """Every path opened (or hard-linked from) through Python while active."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        real_open, real_os_open, real_link = builtins.open, os.open, os.link

        def hooked_open(file, *a, **k):
            if isinstance(file, (str, bytes, os.PathLike)):
                self.paths.append(os.path.abspath(os.fsdecode(file)))
            return real_open(file, *a, **k)

        def hooked_os_open(path, *a, **k):
            self.paths.append(os.path.abspath(os.fsdecode(path)))
            return real_os_open(path, *a, **k)

        def hooked_link(src, dst, *a, **k):
            self.paths.append(os.path.abspath(os.fsdecode(src)))
            return real_link(src, dst, *a, **k)

        monkeypatch.setattr(builtins, "open", hooked_open)
        monkeypatch.setattr(io, "open", hooked_open)
        monkeypatch.setattr(os, "open", hooked_os_open)
        monkeypatch.setattr(os, "link", hooked_link)

    def under(self, root: Path) -> list[Path]:
        r = str(root.resolve())
        return [Path(p) for p in self.paths if os.path.realpath(p).startswith(r + os.sep) or p.startswith(str(root))]


def _snapshot(root: Path, skip: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if skip == p or skip in p.parents:
            continue
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                               sha256_file(p) if p.is_file() and not p.is_symlink() else None)
    return out


@pytest.fixture()
def scratch(tmp_path, tiny_onnx):
    (tmp_path / "victim.txt").write_text("do not touch\n")
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 64)
    shutil.copytree(tiny_onnx, tmp_path / "m")
    (tmp_path / "out").mkdir()
    return tmp_path


def _allowed(p: Path, scratch: Path) -> bool:
    real = Path(os.path.realpath(p))
    return any(root in real.parents or real == root for root in ((scratch / "m").resolve(), (scratch / "out").resolve()))


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_hostile_folder_is_refused_and_confined(scratch, monkeypatch, hostile, verb):
    model, out = scratch / "m", scratch / "out"
    HOSTILE[hostile](model, scratch)
    before = _snapshot(scratch, out)
    log = OpenLog(monkeypatch)
    res = invoke(*VERBS[verb](model, out), timeout=120)
    monkeypatch.undo()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.startswith("error:")]) == 1, res.stderr
    assert _snapshot(scratch, out) == before  # nothing outside OUT changed
    assert list(out.iterdir()) == []  # and nothing half-written inside it
    opened = [p for p in log.under(scratch) if not _allowed(p, scratch)]
    assert opened == [], opened


def test_hook_sees_a_valid_run(scratch, monkeypatch):
    """The open hook is not vacuous: a valid generate is seen reading the model folder, and only it."""
    model, out = scratch / "m", scratch / "out"
    log = OpenLog(monkeypatch)
    res = invoke("generate", model, "a red circle", "--steps", "2", "-o", out / "x.png", timeout=120)
    monkeypatch.undo()
    assert res.returncode == 0, res.stderr
    seen = log.under(scratch)
    assert any(p.name == "manifest.json" for p in seen)
    assert any(p.name == "scheduler_config.json" for p in seen)
    assert [p for p in seen if not _allowed(p, scratch)] == []
    assert (out / "x.png").stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
