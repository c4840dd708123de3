"""`serve` with named LoRA adapters (the request field `lora`), in process (FastAPI's TestClient runs the lifespan).

The embedded SD model with insertion points (`lora points`, made here) and the plain embedded model (its points
copy derived at start-up, adapters/folder.with_points) are served;
the adapters are random LoRA files written here with numpy. A served image with adapters equals the library's
`pipe(..., loras=[(path, scale)])` bit for bit, alone or micro-batched; one without `lora` is unchanged; micro-
batches never mix adapter sets; converted sets live in a bounded LRU; bad `lora` input is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import base64
import io
import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")

from cli_helpers import assert_one_line_error, invoke  # noqa: E402
from lora_helpers import random_lora  # noqa: E402
from onnxdiffusion.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "models" / "shapes-sd-onnx"
GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from onnxdiffusion.adapters import safetensors_io
    from onnxdiffusion.adapters.folder import add_points

    root = tmp_path_factory.mktemp("serve_lora")
    points = root / "sd-lora"
    add_points(EMBEDDED, points)
    adapters = root / "adapters"
    adapters.mkdir()
    files = {"style": random_lora(points, adapters / "style.safetensors", seed=1, rank=4),
             "detail": random_lora(points, adapters / "detail.safetensors", seed=2, rank=2, components=("unet",))}
    (adapters / "notes.txt").write_text("not an adapter: only *.safetensors files are")
    wrong = root / "elsewhere" / "for-another-model.safetensors"  # a layer the model does not have
    wrong.parent.mkdir()
    safetensors_io.write(wrong, {"unet.down_blocks.7.attn.to_q.lora_A.weight": np.zeros((2, 8), np.float32),
                                 "unet.down_blocks.7.attn.to_q.lora_B.weight": np.zeros((8, 2), np.float32)})
    return {"points": points, "dir": adapters, "files": files, "wrong": wrong}


@pytest.fixture(scope="module")
def client(lora_setup):
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    config = ServeConfig(models=(f"sd={lora_setup['points']}", f"plain={EMBEDDED}"), buckets="64x64", workers=1,
                         max_batch=4, max_queue=16, warmup=False, lora_dir=str(lora_setup["dir"]),
                         loras=(f"wrong={lora_setup['wrong']}",), lora_cache=2)
    with TestClient(create_app(config)) as c:
        deadline = time.monotonic() + 240
        while not (ready := c.get("/ready").json())["ready"]:
            assert not ready["error"] and time.monotonic() < deadline, ready
            time.sleep(0.05)
        yield c


@pytest.fixture(scope="module")
def pipe(lora_setup):
    from onnxdiffusion.runtime import Pipeline

    return Pipeline.from_folder(lora_setup["points"], threads=1)


def png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def image(item: dict) -> np.ndarray:
    return png(base64.b64decode(item["b64_json"]))


def catalog(client):
    return client.app.state.service.manager.loras


def test_models_list_the_adapters_of_models_with_insertion_points(client):
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["sd"]["loras"] == ["detail", "style"]  # `wrong` fits no layer of it: not listed
    assert models["plain"]["loras"] == ["detail", "style"]  # a plain export: served from its derived points copy
    assert client.get("/v1/models/sd").json()["loras"] == ["detail", "style"]


def test_lora_images_equal_the_library_and_plain_ones_are_unchanged(client, pipe, lora_setup):
    files = lora_setup["files"]
    body = {"prompt": "a red circle", "model": "sd", "steps": 3, "seed": 3, "n": 2}
    r = client.post(GEN, json={**body, "lora": [{"name": "style", "scale": 0.7}, "detail:-1.5"]})
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["lora"] == [{"name": "style", "scale": 0.7}, {"name": "detail", "scale": -1.5}]
    want = pipe("a red circle", seed=3, steps=3, batch=2, loras=[(files["style"], 0.7), (files["detail"], -1.5)]).images
    for item, ref in zip(r.json()["data"], want):
        np.testing.assert_array_equal(image(item), ref)
    r = client.post(GEN, json={**body, "lora": ["style"]})  # the string form's default scale: 1
    np.testing.assert_array_equal(image(r.json()["data"][1]), pipe("a red circle", seed=3, steps=3, batch=2,
                                                                   loras=[(files["style"], 1.0)]).images[1])
    plain = pipe("a red circle", seed=3, steps=3, batch=2).images
    assert not np.array_equal(plain[0], want[0])
    for extra in ({}, {"lora": None}, {"lora": []}):  # no adapter: the image and the echoed settings as before
        r = client.post(GEN, json={**body, **extra})
        assert r.status_code == 200, r.text
        assert "lora" not in r.json()["settings"]
        for item, ref in zip(r.json()["data"], plain):
            np.testing.assert_array_equal(image(item), ref)
    r = client.post(GEN, json={"prompt": "a red circle", "model": "plain", "steps": 3, "seed": 3})
    from onnxdiffusion.runtime import Pipeline

    np.testing.assert_array_equal(image(r.json()["data"][0]),
                                  Pipeline.from_folder(EMBEDDED, threads=1)("a red circle", seed=3, steps=3).images[0])


def _wait(client, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (s := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, s
        time.sleep(0.02)
    return s


def test_micro_batches_group_only_the_same_adapters_and_scales(client, pipe, lora_setup):
    files = lora_setup["files"]
    blocker = client.post("/v1/jobs", json={"prompt": "a big circle", "model": "sd", "steps": 100}).json()
    deadline = time.monotonic() + 60
    while client.get(f"/v1/jobs/{blocker['id']}").json()["step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # queued behind the blocker (one worker): same settings, four adapter sets
    sets = {"a": [{"name": "style", "scale": 0.5}], "b": [{"name": "style", "scale": 0.25}],
            "c": [{"name": "detail"}, {"name": "style", "scale": 0.5}], "none": None}
    plan = [("a", 11), ("b", 12), ("a", 13), ("none", 14), ("c", 15), ("a", 16), ("none", 17)]
    jobs = []
    for name, seed in plan:
        body = {"prompt": f"a blue star {seed}", "model": "sd", "steps": 3, "seed": seed}
        if sets[name] is not None:
            body["lora"] = sets[name]
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        jobs.append(r.json())
    client.delete(f"/v1/jobs/{blocker['id']}")
    sizes = {"a": 3, "b": 1, "c": 1, "none": 2}
    for (name, seed), job in zip(plan, jobs):
        s = _wait(client, job["id"])
        assert s["status"] == "succeeded" and s["batch_size"] == sizes[name], (name, s)
        loras = [] if sets[name] is None else [(files[i["name"]], i.get("scale", 1.0)) for i in sets[name]]
        want = pipe(f"a blue star {seed}", seed=seed, steps=3, loras=loras).images[0]
        np.testing.assert_array_equal(png(client.get(s["images"][0]).content), want)


def test_adapter_sets_convert_once_in_a_bounded_lru(client, lora_setup, monkeypatch):
    import onnxdiffusion.adapters.feeds as feeds

    calls = []
    real = feeds.build_feeds
    monkeypatch.setattr(feeds, "build_feeds", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    cat = catalog(client)
    cat._sets.clear()
    for scale in (0.1, 0.1, 0.2, 0.1, 0.3, 0.1):  # --lora-cache 2
        r = client.post(GEN, json={"prompt": "x", "model": "sd", "steps": 1, "seed": 1, "lora": [f"style:{scale}"]})
        assert r.status_code == 200, r.text
        assert cat.cached() <= 2
    # 0.1 converted once, 0.2 once, 0.3 once (it evicts 0.2, the least recently used; 0.1 was used since)
    assert [c[0][1] for c in calls] == [0.1, 0.2, 0.3]
    assert [k[1][0][1] for k in cat._sets] == [0.3, 0.1]
    style = lora_setup["files"]["style"]  # a file replaced on disk (here: a new mtime) is converted again
    os.utime(style, ns=(style.stat().st_atime_ns, style.stat().st_mtime_ns + 10**9))
    r = client.post(GEN, json={"prompt": "x", "model": "sd", "steps": 1, "seed": 1, "lora": ["style:0.1"]})
    assert r.status_code == 200 and [c[0][1] for c in calls] == [0.1, 0.2, 0.3, 0.1], r.text


BAD = [
    ("style", "lora must be a list", None),
    ([{"name": "nope"}], "unknown adapter 'nope'", "lora_not_found"),
    ([{"name": "../adapters/style.safetensors"}], "unknown adapter", "lora_not_found"),
    ([{"name": "/etc/passwd"}], "unknown adapter", "lora_not_found"),
    ([{"name": "style", "scale": 5}], "[-4, 4]", "invalid_lora_scale"),
    ([{"name": "style", "scale": True}], "[-4, 4]", "invalid_lora_scale"),
    ([{"name": "style", "scale": "1"}], "[-4, 4]", "invalid_lora_scale"),
    (["style:-4.5"], "[-4, 4]", "invalid_lora_scale"),
    ([{"name": "style", "scale": 10**400}], "[-4, 4]", "invalid_lora_scale"),
    (["style:1e400"], "[-4, 4]", "invalid_lora_scale"),
    (["style:abc"], "must be a number", None),
    ([{"name": "style", "weight": 1}], "unknown field 'weight'", None),
    ([{"scale": 1}], "`name` must be a non-empty string", None),
    ([7], "got int", None),
    (["style", "style:0.5"], "named twice", None),
    ([f"style:{i / 10}" for i in range(9)], "at most 8", None),
    ([{"name": "wrong"}], "does not fit model sd", "lora_not_compatible"),
]


@pytest.mark.parametrize("route", [GEN, "/v1/jobs"])
def test_bad_lora_is_a_clean_400(client, lora_setup, route):
    for lora, fragment, code in BAD:
        r = client.post(route, json={"prompt": "x", "model": "sd", "steps": 1, "lora": lora})
        assert r.status_code == 400, (lora, r.text)
        err = r.json()["error"]
        assert err["param"] == "lora" and err["code"] == code and fragment in err["message"], (lora, err)
        assert err["type"] == "invalid_request_error" and "Traceback" not in r.text
        assert str(lora_setup["wrong"].parent) not in r.text and str(lora_setup["dir"]) not in r.text  # no paths
    # a plain export takes adapters too (its insertion points are derived once at start-up): the same image
    same = {"prompt": "x", "steps": 2, "seed": 1, "lora": ["style:0.5"]}
    r = client.post(route, json={**same, "model": "plain"})
    if route == GEN:
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(image(r.json()["data"][0]),
                                      image(client.post(route, json={**same, "model": "sd"}).json()["data"][0]))
    nan = client.post(route, content=b'{"prompt": "x", "model": "sd", "lora": [{"name": "style", "scale": NaN}]}',
                      headers={"content-type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["code"] == "invalid_lora_scale", nan.text
    assert client.post(route, json={"prompt": "still up", "model": "sd", "steps": 1, "lora": ["detail:0.5"]}).status_code in (200, 202)


def test_edit_with_an_adapter_equals_the_library(client, pipe, lora_setup):
    from PIL import Image

    rgb = np.zeros((64, 64, 3), np.uint8)
    rgb[16:48, 8:40] = (220, 40, 40)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    files = {"image": ("scene.png", buf.getvalue(), "image/png")}
    fields = {"prompt": "a blue circle", "model": "sd", "steps": "4", "seed": "5", "strength": "0.7"}
    for form in ("style:0.6, detail:-1", '[{"name": "style", "scale": 0.6}, "detail:-1"]'):
        r = client.post("/v1/images/edits", files=files, data={**fields, "lora": form})
        assert r.status_code == 200, r.text
        assert r.json()["settings"]["lora"] == [{"name": "style", "scale": 0.6}, {"name": "detail", "scale": -1.0}]
        want = pipe("a blue circle", image=rgb, strength=0.7, seed=5, steps=4,
                    loras=[(lora_setup["files"]["style"], 0.6), (lora_setup["files"]["detail"], -1.0)]).images[0]
        np.testing.assert_array_equal(image(r.json()["data"][0]), want)
    r = client.post("/v1/images/edits", files=files, data={**fields, "lora": "[{oops"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
    r = client.post("/v1/images/edits", files=files, data={**fields, "lora": "nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_found", r.text


def test_adapter_options_are_checked_at_start_up(lora_setup, tmp_path):
    from onnxdiffusion.serve.loras import adapter_files

    files = adapter_files(str(lora_setup["dir"]), [f"w={lora_setup['wrong']}"])
    assert sorted(files) == ["detail", "style", "w"] and all(p.is_absolute() for p in files.values())
    assert sorted(adapter_files(None, [str(lora_setup["wrong"])])) == ["for-another-model"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad name!.safetensors").write_bytes(b"")
    (tmp_path / "model.ckpt").write_bytes(b"")
    cases = [
        ((str(tmp_path / "missing"), []), "not a folder"),
        ((str(tmp_path / "empty"), []), "no *.safetensors"),
        ((str(tmp_path), []), "adapter name 'bad name!'"),
        ((None, [f"x={tmp_path / 'gone.safetensors'}"]), "no such file"),
        ((None, [f"x={tmp_path / 'model.ckpt'}"]), ".safetensors files"),
        ((str(lora_setup["dir"]), [f"style={lora_setup['wrong']}"]), "two adapters are named 'style'"),
    ]
    for args, fragment in cases:
        with pytest.raises(UserError) as e:
            adapter_files(*args)
        assert fragment in str(e.value), str(e.value)
    proc = invoke("serve", "--lora-dir", tmp_path / "missing")
    assert_one_line_error(proc, "--lora-dir", "not a folder")
    proc = invoke("serve", "--lora", f"x={lora_setup['wrong']}", "--ray")
    assert_one_line_error(proc, "--ray", "LoRA")
    proc = invoke("serve", "--lora-cache", "0")
    assert_one_line_error(proc, "lora-cache")
