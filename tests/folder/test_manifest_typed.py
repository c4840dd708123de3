"""The typed manifest (issue 41): records built by the validation on read, frozen, byte-identical when written
back, a newer writer's unknown keys kept through a read-modify-write, and one atomic writer."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from onnxdiffusion.folder.artifacts import MANIFEST, derive, read_manifest, write_manifest
from onnxdiffusion.errors import UserError
from onnxdiffusion.folder.manifest import Component, Manifest, PipelineInfo, manifest_bytes, typed

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = [ROOT / "models" / "shapes-sd-onnx", ROOT / "models" / "shapes-mmdit-onnx"]


@pytest.mark.parametrize("folder", EMBEDDED, ids=lambda p: p.name)
def test_written_back_byte_identical(folder):
    m = read_manifest(folder)
    assert manifest_bytes(m) == (folder / MANIFEST).read_bytes()
    assert manifest_bytes(m.to_dict()) == manifest_bytes(m)


@pytest.mark.parametrize("folder", EMBEDDED, ids=lambda p: p.name)
def test_typed_fields_are_the_json_values(folder):
    raw = json.loads((folder / MANIFEST).read_text())
    m = read_manifest(folder)
    assert isinstance(m, Manifest) and isinstance(m.pipeline, PipelineInfo)
    assert m.family == raw["family"] and m.format_version == raw["format_version"]
    for key in PipelineInfo._REQUIRED:
        assert getattr(m.pipeline, key) == raw["pipeline"][key]
    assert dict(m.files) == raw["files"]
    for name, entry in raw["components"].items():
        c = m.components[name]
        assert isinstance(c, Component) and c.name == name and c.path == entry["path"]
        assert list(c.external_data) == entry.get("external_data", [])
        assert [t.name for t in c.inputs] == [t["name"] for t in entry.get("inputs", [])]
        assert [list(t.shape) for t in c.outputs] == [t["shape"] for t in entry.get("outputs", [])]
        assert c.bytes == entry.get("bytes") and c.precision == entry.get("precision")


def test_records_are_frozen(tiny_onnx):
    m = read_manifest(tiny_onnx)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.family = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.pipeline.vae_scale_factor = 2
    with pytest.raises(TypeError):
        m.components["vae_decoder"] = m.components["unet"]
    draft = m.to_dict()  # a writer's own copy: editing it leaves the record alone
    draft["pipeline"]["vae_scale_factor"] = 1
    assert m.pipeline.vae_scale_factor != 1 and m.to_dict()["pipeline"]["vae_scale_factor"] != 1


def test_unknown_keys_survive_read_modify_write(tiny_onnx, tmp_path):
    """A newer writer's fields (top level, pipeline, a component, a new component) come through a derive."""
    src = tmp_path / "src"
    shutil.copytree(tiny_onnx, src)
    draft = json.loads((src / MANIFEST).read_text())
    draft["zz_newer_tool"] = {"a": [1, 2]}
    draft["pipeline"]["zz_setting"] = 3
    first = next(iter(draft["components"]))
    draft["components"][first]["zz_note"] = "kept"
    write_manifest(src, draft)
    before = (src / MANIFEST).read_bytes()
    m = read_manifest(src)
    assert m.setting("zz_newer_tool") == {"a": [1, 2]} and m.pipeline.setting("zz_setting") == 3
    assert m.components[first].setting("zz_note") == "kept"
    assert manifest_bytes(m) == before  # key order and all
    out = tmp_path / "out"
    with derive(src, out, m):
        pass  # nothing replaced: the copy's manifest is the source's, hashes and all
    assert (out / MANIFEST).read_bytes() == before


def test_read_fills_defaults_as_before(tiny_onnx, tmp_path):
    """Validation fills `family`, `external_data` and `recommended`; written back they are there (as before)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_onnx, src)
    draft = json.loads((src / MANIFEST).read_text())
    del draft["family"], draft["recommended"]
    for entry in draft["components"].values():
        entry.pop("external_data", None)
    write_manifest(src, draft)
    m = read_manifest(src)
    assert m.family == "sd" and m.recommended.steps is None
    assert all(c.external_data == () for c in m.components.values())
    written = json.loads(manifest_bytes(m))
    assert written["family"] == "sd" and written["recommended"] == {}
    assert list(written)[-2:] == ["family", "recommended"]  # appended where validation puts them


def test_typed_validates_a_plain_dict_and_refuses_a_bad_one(tiny_onnx):
    raw = json.loads((tiny_onnx / MANIFEST).read_text())
    assert typed(raw).pipeline.latent_channels == raw["pipeline"]["latent_channels"]
    raw["components"]["unet"]["path"] = "../outside.onnx"
    with pytest.raises(UserError, match="components.unet.path"):
        typed(raw)


def test_write_manifest_is_atomic(tiny_onnx, tmp_path, monkeypatch):
    """A failing write leaves the old manifest and no temporary file."""
    import os

    src = tmp_path / "src"
    shutil.copytree(tiny_onnx, src)
    before = (src / MANIFEST).read_bytes()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_manifest(src, read_manifest(src))
    assert (src / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in src.iterdir() if p.name.startswith(f".{MANIFEST}")) == []


def test_mapping_view_for_not_yet_converted_readers(tiny_onnx):
    """The allow-listed modules (tests/house/test_house_rules.py) still index by string: the same values."""
    m = read_manifest(tiny_onnx)
    assert m["pipeline"]["vae_scale_factor"] == m.pipeline.vae_scale_factor
    assert m["components"]["unet"]["path"] == m.components["unet"].path
    assert m.get("controlnets") is None and "files" in m


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["components"]["unet"].update(lora=5), "components.unet.lora"),
    (lambda m: m["components"]["unet"].update(bytes="big"), "components.unet.bytes"),
    (lambda m: m["components"]["unet"].update(fallback={"path": "../elsewhere.onnx"}), "components.unet.fallback.path"),
    (lambda m: m["components"]["unet"].update(controlnets="edges"), "components.unet.controlnets"),
    (lambda m: m.update(controlnets={"edges": {"path": "/etc/passwd"}}), "controlnets.edges.path"),
    (lambda m: m.update(controlnets=[1]), "controlnets"),
])
def test_the_records_typed_on_read_are_checked_on_read(tiny_onnx, edit, field):
    """Fields the records type (beyond the original schema) fail in one line naming them, never in a consumer."""
    raw = json.loads((tiny_onnx / MANIFEST).read_text())
    edit(raw)
    with pytest.raises(UserError, match=f"manifest field '{field}'"):
        typed(raw)


def test_records_pickle_and_deep_copy(tiny_onnx):
    """Serve and bench hand pipelines to workers: the records rebuild from their JSON."""
    import copy
    import pickle

    m = read_manifest(tiny_onnx)
    for other in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert isinstance(other, Manifest) and manifest_bytes(other) == manifest_bytes(m)
        assert other.components["unet"].path == m.components["unet"].path
    assert pickle.loads(pickle.dumps(m.pipeline)).latent_channels == m.pipeline.latent_channels
