"""Property test: 500 mutations of manifest.json and scheduler_config.json, each run through `generate`.

Each mutation replaces one value anywhere in the JSON (by a hostile JSON value), deletes a key, or adds
one. The outcome must be a one-line error (exit 2) or a valid run (exit 0, an image written) - never a
traceback or an internal error. ONNX Runtime sessions are cached by file content so that the 500 runs
stay fast; everything else (reading, validation, tokenizing, sampling, decoding) runs for real.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cli_helpers import invoke  # noqa: E402

from onnxdiffusion.folder.artifacts import sha256_file  # noqa: E402

pytestmark = pytest.mark.slow

HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2, 3, 7, 16, 64, 1000, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "../x", "/etc/passwd", "unet/model.onnx", "text_encoder/model.onnx", "a\x00b", "epsilon",
                     "v_prediction", "linear", "trailing", "ddim", "euler", "0" * 64, "é", "\udcff"]),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(obj, prefix=()):
    """Every (container path, key) in a JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


_READ = {"format_version", "family", "family_config", "pipeline", "components", "files", "recommended", "quantization"}


def _consumed(path: tuple) -> bool:
    if path[0] == "components" and len(path) > 2:
        return path[2] in ("path", "external_data", "session_options", "correction", "kind", "form", "steps")
    return path[0] in _READ or path[0] in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule",
                                           "prediction_type", "steps_offset", "timestep_spacing", "set_alpha_to_one")


def _mutate(doc, draw):
    doc = json.loads(json.dumps(doc))
    paths = list(_paths(doc))
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "root"]))
    if kind == "root":
        return draw(HOSTILE_VALUES)
    read = [p for p in paths if _consumed(p)]
    # mostly fields a consumer reads (mutating provenance fields is always a valid run, and slower)
    path = draw(st.sampled_from(read if read and draw(st.integers(0, 9)) < 8 else paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if kind == "delete" and isinstance(parent, dict):
        del parent[key]
    elif kind == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=6))] = draw(HOSTILE_VALUES)
    else:
        parent[key] = draw(HOSTILE_VALUES)
    return doc


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_onnx):
    dst = tmp_path_factory.mktemp("prop") / "model"
    shutil.copytree(tiny_onnx, dst)
    return dst


@pytest.fixture(scope="module", autouse=True)
def cached_sessions():
    """One ORT session per distinct file content (the mutations never change ONNX files)."""
    from onnxdiffusion.runtime import loading, session, session_makers

    real = session.make_session
    cache: dict = {}

    def make(path, *a, **k):
        key = (hashlib.sha256(Path(path).read_bytes()).hexdigest(), a, tuple(sorted((k or {}).items())))
        if key not in cache:
            cache[key] = real(path, *a, **k)
        return cache[key]

    mp = pytest.MonkeyPatch()
    for module in (session_makers, loading):  # Pipeline's sessions come from session_makers, the backbone's loading
        mp.setattr(module, "make_session", make)
    yield
    mp.undo()


COUNTS = {"runs": 0, "ok": 0, "refused": 0}


@settings(max_examples=500, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutations_give_one_line_error_or_valid_run(folder, data):
    manifest_path = folder / "manifest.json"
    sched_path = folder / "scheduler" / "scheduler_config.json"
    if not hasattr(test_mutations_give_one_line_error_or_valid_run, "originals"):
        test_mutations_give_one_line_error_or_valid_run.originals = (manifest_path.read_text(), sched_path.read_text())
    manifest_text, sched_text = test_mutations_give_one_line_error_or_valid_run.originals
    manifest_path.write_text(manifest_text)
    sched_path.write_text(sched_text)
    out = folder.parent / "out.png"
    out.unlink(missing_ok=True)

    target = data.draw(st.sampled_from(["manifest", "manifest", "scheduler"]))
    if target == "manifest":
        mutated = _mutate(json.loads(manifest_text), data.draw)
        manifest_path.write_text(json.dumps(mutated, allow_nan=True))
    else:
        mutated = _mutate(json.loads(sched_text), data.draw)
        sched_path.write_text(json.dumps(mutated, allow_nan=True))
        m = json.loads(manifest_text)  # keep the hash list true, so the scheduler's own validation is reached
        m["files"]["scheduler/scheduler_config.json"] = sha256_file(sched_path)
        manifest_path.write_text(json.dumps(m))

    res = invoke("generate", folder, "a red circle", "--steps", "1", "-o", out, timeout=60)
    COUNTS["runs"] += 1
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    if res.returncode == 0:
        COUNTS["ok"] += 1
        assert errors == [] and out.is_file(), res.stderr
    else:
        COUNTS["refused"] += 1
        assert res.returncode == 2, res.stderr
        assert len(errors) == 1 and "internal error" not in errors[0], res.stderr
        assert not out.exists()


def test_mutation_count():
    """Runs after the property test (file order): all 500 examples ran, and both outcomes occurred."""
    if COUNTS["runs"] == 0:
        pytest.skip("property test not run in this session")
    assert COUNTS["runs"] >= 500, COUNTS
    assert COUNTS["ok"] > 0 and COUNTS["refused"] > 0, COUNTS
    print(f"mutations: {COUNTS}")
