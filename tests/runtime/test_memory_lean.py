"""`memory=lean` (runtime/memory.py): same images as the default, the text encoder session really let go."""

from __future__ import annotations

import gc
import io
import threading
import time
import weakref

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.memory import MEMORY_MODES, LazySession, MemoryOptions, memory_options
from onnxdiffusion.runtime.session import session_options

pytestmark = pytest.mark.slow

SETTINGS = dict(steps=4, seed=7, guidance=4.0)


@pytest.fixture(scope="module")
def pipes():
    return Pipeline.from_folder(None, threads=1), Pipeline.from_folder(None, threads=1, memory="lean")


def test_lean_images_identical_and_text_encoder_dropped(pipes):
    # its own lean pipeline: the load counts below start at construction, whichever test of this module (and
    # of the shared fixture) an xdist worker ran first
    default, lean = pipes[0], Pipeline.from_folder(None, threads=1, memory="lean")
    assert lean.memory == MEMORY_MODES["lean"] and default.memory == MemoryOptions()
    holder = lean.text_sessions["text_encoder"]
    # loaded once at construction (its I/O is checked there) and kept for the first encoding, which also runs
    # guards.probe_text's checks (no empty-prompt encoding at load in lean mode); let go after every encoding
    assert holder.loads == 1 and holder.loaded
    session = weakref.ref(holder.get())  # the load-time session, used by the first generation below
    for prompt in ("a red circle on the left", "a blue star above a yellow square"):
        a = default(prompt, **SETTINGS)
        b = lean(prompt, **SETTINGS)
        assert np.array_equal(a.images, b.images)
        assert np.array_equal(a.latents, b.latents)
        assert not holder.loaded
        gc.collect()
        assert session() is None, "the released text encoder session is still referenced somewhere"
    # one load per generation (prompt and the negative/empty prompt share it; the first uses construction's),
    # none kept in between
    assert holder.loads == 2
    kept = default.text_sessions["text_encoder"]
    assert kept.loaded and kept.loads == 1  # whatever ran before on the fixture's default pipeline: loaded once


def test_lean_negative_prompt_and_held_encoders(pipes):
    default, lean = pipes
    a = default("a red circle", negative_prompt="a blue square", **SETTINGS)
    b = lean("a red circle", negative_prompt="a blue square", **SETTINGS)
    assert np.array_equal(a.images, b.images)
    holder = lean.text_sessions["text_encoder"]
    loads = holder.loads
    with lean.holding_text_encoders():
        lean.encode_prompt(["x"])
        lean.encode_prompt(["y"])
        assert holder.loaded  # held: not let go between the two encodings
    assert not holder.loaded and holder.loads == loads + 1


def test_lazy_session_is_released_only_by_its_last_user():
    made = []
    holder = LazySession(lambda: made.append(object()) or made[-1], release=True)
    entered, go = threading.Event(), threading.Event()

    def other():
        with holder.use():
            holder.get()
            entered.set()
            go.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(10)
    with holder.use():
        first = holder.get()
    assert holder.loaded and holder.get() is first  # the other thread still uses it
    go.set()
    t.join(10)
    assert not holder.loaded and len(made) == 1


def test_memory_options_parsing_and_session_options():
    assert memory_options(None) == MemoryOptions()
    assert memory_options("lean,arena=0") == MemoryOptions(release_text_encoders=True, mem_pattern=False, arena=False)
    assert memory_options("prepacking=0").prepacking is False
    for bad in ("tiny", "arena=2", "swap=1"):
        with pytest.raises(UserError):
            memory_options(bad)
    lean = session_options(1, memory_options("lean,prepacking=0,arena=0"))
    assert lean.get_session_config_entry("session.disable_prepacking") == "1"
    assert lean.enable_cpu_mem_arena is False and lean.enable_mem_pattern is False
    plain = session_options(1, MemoryOptions())
    assert plain.enable_cpu_mem_arena is True and plain.enable_mem_pattern is True


def test_profile_memory_field(tmp_path):
    from onnxdiffusion.profiles import load_profile

    path = tmp_path / "lean.yaml"
    path.write_text("version: 1\nname: lean-cpu\nprovider: cpu\nmemory: lean\n")
    pipe = Pipeline.from_folder(None, threads=1, profile=str(path))
    assert pipe.memory == MEMORY_MODES["lean"]
    assert Pipeline.from_folder(None, threads=1, profile=str(path), memory="default").memory == MemoryOptions()
    path.write_text("version: 1\nname: bad\nprovider: cpu\nmemory: tiny\n")
    with pytest.raises(UserError, match="memory mode"):
        load_profile(str(path))


def test_serve_lean_concurrent_workers_match_generate(pipes):
    """Two workers render at once with encoders let go after each encoding: same images as the library."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from PIL import Image

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    default, _ = pipes
    config = ServeConfig(buckets="64x64", workers=2, max_batch=1, memory="lean", warmup=False)
    prompts = ["a red circle", "a green triangle at the bottom", "a blue square", "a yellow star"]
    with TestClient(create_app(config)) as client:
        deadline = time.time() + 60
        while not client.get("/ready").status_code == 200 and time.time() < deadline:
            time.sleep(0.1)
        ids = [client.post("/v1/jobs", json={"prompt": p, "size": "64x64", "steps": 4, "seed": 7,
                                             "guidance": 4.0}).json()["id"] for p in prompts]
        results = {}
        while len(results) < len(ids) and time.time() < deadline:
            for i in ids:
                job = client.get(f"/v1/jobs/{i}").json()
                if job["status"] in ("succeeded", "failed", "cancelled", "timeout"):
                    results[i] = job
            time.sleep(0.1)
        (entry,) = client.app.state.service.manager.models.values()
        assert entry.pipeline.memory == MEMORY_MODES["lean"]
        assert not entry.pipeline.text_sessions["text_encoder"].loaded
        assert entry.pipeline.text_sessions["text_encoder"].loads >= 2
        for i, prompt in zip(ids, prompts):
            assert results[i]["status"] == "succeeded", results[i]
            png = client.get(results[i]["images"][0]).content
            image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            assert np.array_equal(image, default(prompt, **SETTINGS).images[0])


def test_store_external_same_images_and_verified_manifest(tmp_path, pipes):
    from onnxdiffusion.folder.artifacts import read_manifest, verify_folder
    from onnxdiffusion.folder.paths import default_model_folder
    from onnxdiffusion.folder.relayout import store_external

    out = tmp_path / "ext"
    done = store_external(default_model_folder(), out, min_bytes=0)
    assert "unet" in done and "text_encoder" in done
    manifest = read_manifest(out)
    verify_folder(out, manifest)  # hashes of the new files, external data listed
    for name in done:
        info = manifest["components"][name]
        assert info["external_data"] == [f"{name}/model.onnx_data"] and (out / name / "model.onnx_data").is_file()
        assert (out / info["path"]).stat().st_size < 0.2 * info["bytes"]  # the graph file holds no weights
    default, _ = pipes
    a = default("a red circle", **SETTINGS)
    b = Pipeline.from_folder(out, threads=1, memory="lean")("a red circle", **SETTINGS)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.latents, b.latents)


def test_quantize_writes_weights_beside_the_graph_from_the_threshold(tmp_path, monkeypatch):
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.folder.paths import default_model_folder
    from onnxdiffusion.quantize import QuantizeConfig, quantize, recipe_class
    from onnxdiffusion.quantize import api

    def run(out):
        cfg = QuantizeConfig(recipe=recipe_class("int8-dynamic")(), latency_runs=1, measure_memory=False)
        quantize(default_model_folder(), out, cfg, measure_quality=False, log=lambda m: None)
        return read_manifest(out)["components"]["unet"]

    assert run(tmp_path / "inline")["external_data"] == []  # a 6 MB backbone stays inline
    monkeypatch.setattr(api, "RUNTIME_EXTERNAL_BYTES", 1 << 20)
    assert run(tmp_path / "ext")["external_data"] == ["unet/model.onnx_data"]


def test_heap_frozen_collects_what_the_block_made_and_unfreezes():
    """export's HeapFrozen (onnxio): collections skip what lived before, still free cycles made inside the block,
    and leave nothing frozen after it."""
    from onnxdiffusion.onnxio import HeapFrozen

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.unfreeze()  # (tests/conftest.py freezes at each module's first test: a process's own freezing)
    before = cycle()  # garbage already: the block's first collection frees it
    with HeapFrozen() as heap:
        assert before() is None and gc.get_freeze_count() > 0
        inside = cycle()
        assert inside() is not None  # a cycle: only a collection frees it
        heap.settle()
        assert inside() is None
        kept = Node()
        kept.me = kept
        heap.settle()  # alive: frozen now
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    del kept
    gc.freeze()
    with HeapFrozen():  # the process froze objects itself: they stay frozen after the block
        pass
    assert gc.get_freeze_count() > 0


def test_bounded_releases_backbone_before_decode(pipes):
    """memory=bounded: the backbone's session is let go before the VAE decode (and made again for the next
    generation); no packed copies, no arena; the image is the default's up to the unpacked kernels' rounding."""
    default = pipes[0]
    bounded = Pipeline.from_folder(None, threads=1, memory="bounded")
    assert bounded.memory.release_backbone and not bounded.memory.prepacking and not bounded.memory.arena
    seen, sessions = [], []
    decode, make = bounded.decode, bounded._backbone._make

    def spy(*a, **kw):
        gc.collect()
        seen.append((bounded.backbone_loaded, [s() for s in sessions]))
        return decode(*a, **kw)

    def made():
        session = make()
        sessions.append(weakref.ref(session))
        return session

    bounded._backbone._make = made

    bounded.decode = spy
    for prompt in ("a red circle on the left", "a blue star above a yellow square"):
        a, b = default(prompt, **SETTINGS), bounded(prompt, **SETTINGS)
        assert np.abs(a.images.astype(int) - b.images.astype(int)).max() <= 2
        assert not bounded.backbone_loaded
    assert seen == [(False, [None]), (False, [None, None])], "the released backbone session is still referenced"
    assert memory_options("bounded,prepacking=1").prepacking is True
