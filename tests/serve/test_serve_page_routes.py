"""The routes the page at `/` uses beyond the OpenAI ones (serve/page_routes.py), in process (FastAPI's TestClient):
`GET /v1/page/models` (what each model offers), `POST /v1/jobs/edits` (a picture or ControlNet job answered at
once, streaming previews, cancellable) -- its images equal /v1/images/edits' and the library's; bad input is a 400
in OpenAI's error shape and the server keeps serving. The page itself is driven in tests/serve/test_serve_page.py."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")

from test_serve import EMBEDDED, assert_clean_error, decode_png  # noqa: E402

MMDIT = EMBEDDED.parent / "shapes-mmdit-onnx"
PROMPT = "a red circle on the left"


def png(array: np.ndarray, mode: str | None = None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture(h: int = 64, w: int = 64) -> np.ndarray:
    rgb = np.full((h, w, 3), 90, np.uint8)
    rgb[8 : h // 2, 8 : w // 2] = (220, 40, 40)
    return rgb


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    config = ServeConfig(models=(f"sd={EMBEDDED}", f"mmdit={MMDIT}"), buckets="64x64", workers=1, max_batch=1,
                         warmup=False)
    with TestClient(create_app(config)) as c:
        deadline = time.monotonic() + 240
        while not (ready := c.get("/ready").json())["ready"]:
            assert not ready["error"] and time.monotonic() < deadline, ready
            time.sleep(0.05)
        yield c


def wait_job(client, job_id: str, final=("succeeded", "failed", "cancelled", "timeout")) -> dict:
    deadline = time.monotonic() + 120
    while (snap := client.get(f"/v1/jobs/{job_id}").json())["status"] not in final:
        assert time.monotonic() < deadline, snap
        time.sleep(0.02)
    return snap


def job_edit(client, files: dict, **fields):
    return client.post("/v1/jobs/edits", files={k: (f"{k}.png", v, "image/png") for k, v in files.items()},
                       data={k: str(v) for k, v in fields.items()})


def test_page_is_one_answer_with_its_parts(client):
    html = client.get("/").text
    assert "<!-- part:" not in html and "const Picture" in html and "/v1/page/models" in html and "</style>" in html


def test_models_say_what_each_offers(client):
    body = client.get("/v1/page/models").json()
    models = {m["id"]: m for m in body["data"]}
    assert body["default_model"] == "sd" and body["max_steps"] == 100
    sd, mm = models["sd"], models["mmdit"]
    assert sd["controlnets"] == ["position"] and mm["controlnets"] == []
    assert sd["loras"] == [] and sd["lora_scale"] == [-4.0, 4.0]  # no insertion points: nothing to pick
    sd_samplers = {s["name"]: s["from_picture"] for s in sd["samplers"]}
    assert sd_samplers["ddim"] and "flow_euler" not in sd_samplers
    assert not sd_samplers["lcm"]  # the page greys it out while a picture is set (the edit route refuses it)
    assert "flow_euler" in {s["name"] for s in mm["samplers"]} and "ddim" not in {s["name"] for s in mm["samplers"]}
    assert mm["defaults"]["sampler"] == "flow_euler" and sd["defaults"]["steps"] == 20
    assert sd["takes_picture"] and not sd["needs_mask"]


def test_picture_job_streams_previews_and_equals_the_edit_route(client):
    rgb = picture(70, 100)
    mask = np.full((70, 100, 4), 255, np.uint8)
    mask[:, 50:, 3] = 0
    fields = dict(prompt=PROMPT, model="sd", steps=6, seed=4, strength=0.9)
    r = job_edit(client, {"image": png(rgb), "mask": png(mask)}, **fields)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["notices"] and "resized to 64x64" in job["notices"][0] and job["settings"]["mask"] == "mask"
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as events:
        text = "".join(events.iter_text())
    assert text.count('"preview"') >= 2 and "event: done" in text
    assert wait_job(client, job["id"])["status"] == "succeeded"
    got = decode_png(client.get(f"/v1/jobs/{job['id']}/images/0").content)
    r = client.post("/v1/images/edits", files={"image": ("i.png", png(rgb), "image/png"),
                                               "mask": ("m.png", png(mask), "image/png")},
                    data={k: str(v) for k, v in fields.items()})
    assert r.status_code == 200, r.text
    import base64

    np.testing.assert_array_equal(got, decode_png(base64.b64decode(r.json()["data"][0]["b64_json"])))


def test_picture_job_cancels_mid_run(client):
    r = job_edit(client, {"image": png(picture())}, prompt=PROMPT, model="sd", steps=100, seed=1, strength=1)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while client.get(f"/v1/jobs/{job_id}").json()["step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    snap = wait_job(client, job_id)
    assert snap["status"] == "cancelled" and snap["step"] < 100, snap


def test_controlnet_without_a_picture_is_the_library_image(client):
    from onnxdiffusion.runtime import Pipeline

    control = np.zeros((64, 64, 3), np.uint8)
    control[30:50, 10:30] = 255
    r = job_edit(client, {"control": png(control)}, prompt=PROMPT, model="sd", steps=5, seed=9,
                 controlnet="position:0.8:0:0.9")
    assert r.status_code == 202, r.text
    assert r.json()["settings"]["controlnet"] == {"name": "position", "scale": 0.8, "start": 0.0, "end": 0.9}
    assert "strength" not in r.json()["settings"]
    job_id = r.json()["id"]
    assert wait_job(client, job_id)["status"] == "succeeded"
    got = decode_png(client.get(f"/v1/jobs/{job_id}/images/0").content)
    pipe = Pipeline.from_folder(EMBEDDED, threads=1)
    want = pipe(PROMPT, seed=9, steps=5, width=64, height=64, controlnets=[("position", control, 0.8, 0.0, 0.9)])
    np.testing.assert_array_equal(got, want.images[0])
    assert not np.array_equal(got, pipe(PROMPT, seed=9, steps=5, width=64, height=64).images[0])


@pytest.mark.parametrize("case, param, code", [
    ("json", None, "invalid_body"),
    ("corrupt", "image", "invalid_image"),
    ("mask size", "mask", "mask_size_mismatch"),
    ("strength without picture", "strength", None),
    ("unknown controlnet", "controlnet", "unknown_controlnet"),
    ("control without net", "controlnet", None),
    ("controlnet on a model without", "controlnet", "unknown_controlnet"),
    ("unknown lora", "lora", None),
    ("unknown sampler", "sampler", None),
    ("unknown field", "nope", "unknown_field"),
])
def test_bad_input_is_a_400_and_the_server_serves_on(client, case, param, code):
    ok = png(picture())
    control = {"control": png(picture())}
    r = {
        "json": lambda: client.post("/v1/jobs/edits", json={"prompt": PROMPT}),
        "corrupt": lambda: job_edit(client, {"image": ok[:60]}, prompt=PROMPT),
        "mask size": lambda: job_edit(client, {"image": ok, "mask": png(np.zeros((32, 32, 4), np.uint8))}, prompt=PROMPT),
        "strength without picture": lambda: job_edit(client, control, prompt=PROMPT, controlnet="position", strength=0.5),
        "unknown controlnet": lambda: job_edit(client, control, prompt=PROMPT, controlnet="edges"),
        "control without net": lambda: job_edit(client, control, prompt=PROMPT),
        "controlnet on a model without": lambda: job_edit(client, control, prompt=PROMPT, model="mmdit",
                                                          controlnet="position"),
        "unknown lora": lambda: job_edit(client, {"image": ok}, prompt=PROMPT, lora='[{"name": "ghost"}]'),
        "unknown sampler": lambda: job_edit(client, {"image": ok}, prompt=PROMPT, sampler="Euler a"),
        "unknown field": lambda: job_edit(client, {"image": ok}, prompt=PROMPT, nope=1),
    }[case]()
    assert_clean_error(r, 400, param)
    if code is not None:
        assert r.json()["error"]["code"] == code, r.json()
    r = job_edit(client, {"image": ok}, prompt=PROMPT, steps=2, seed=1)
    assert r.status_code == 202 and wait_job(client, r.json()["id"])["status"] == "succeeded"


@pytest.mark.parametrize("form", ["picture", "control only"])
def test_missing_prompt_reads_as_on_the_edits_route(client, form):
    """One validator (edits.form_body) for both multipart routes: a missing field is the same answer on each."""
    files = {"image": png(picture())} if form == "picture" else {"control": png(picture())}
    more = {} if form == "picture" else {"controlnet": "position"}
    r = job_edit(client, files, **more)
    assert_clean_error(r, 400, "prompt")
    err = r.json()["error"]
    assert err["code"] == "missing_field" and err["message"] == "missing required field 'prompt'", err
    ref = client.post("/v1/images/edits", files={k: (f"{k}.png", v, "image/png") for k, v in files.items()},
                      data={k: str(v) for k, v in more.items()})
    assert ref.status_code == 400 and ref.json()["error"] == err, ref.json()


@pytest.mark.parametrize("route", ["/v1/jobs/edits", "/v1/jobs/edits (control only)", "/v1/images/edits"])
def test_a_tuned_folders_cache_with_a_controlnet_is_the_tables_400(client, monkeypatch, route):
    """serve refuses the pairs of the techniques registry's CONFLICTS table before queueing, in the library's
    words: here a tuned folder's recommended step cache (the model's own) with a requested ControlNet."""
    from dataclasses import replace

    from onnxdiffusion.techniques.registry import conflict

    pipe = client.app.state.service.manager.models["sd"].pipeline
    monkeypatch.setattr(pipe, "recommended", replace(pipe.recommended, cache="first_block:0.1"))
    files = {"control": png(picture())}
    if "control only" not in route:
        files["image"] = png(picture())
    r = client.post(route.split(" ")[0], files={k: (f"{k}.png", v, "image/png") for k, v in files.items()},
                    data={"prompt": PROMPT, "controlnet": "position", "model": "sd"})
    assert_clean_error(r, 400, "controlnet")
    err = r.json()["error"]
    assert err["code"] == "techniques_conflict" and err["message"] == conflict("cache", "controlnet", "host").message


@pytest.mark.parametrize("lora, schedule, cache, inpaint, pair", [
    (True, False, None, False, ("lora", "controlnet")),
    (False, True, None, False, ("controlnet", "precision_schedule")),
    (False, False, "first_block:0.1", True, ("cache", "controlnet")),
    (False, False, "first_block:0", False, None),  # a cache that changes nothing is not on
    (True, False, None, True, None),
])
def test_refuse_conflicts_reads_the_table(lora, schedule, cache, inpaint, pair):
    from dataclasses import replace
    from types import SimpleNamespace

    from onnxdiffusion.serve.edits import refuse_conflicts
    from onnxdiffusion.serve.schemas import RequestError
    from onnxdiffusion.techniques.registry import conflict

    pipe = SimpleNamespace(resolve=lambda o: replace(o, cache=cache), precision_schedule=object() if schedule else None,
                           backbone_extra_channels=lambda: 0)
    entry = SimpleNamespace(id="m", pipeline=pipe)
    req = SimpleNamespace(steps=4, sampler="euler", guidance=5.0, lora=object() if lora else None)
    if pair is None:
        refuse_conflicts(entry, req, controlnet=not lora, inpaint=inpaint)
        return
    with pytest.raises(RequestError) as e:
        refuse_conflicts(entry, req, controlnet=True, inpaint=inpaint)
    assert str(e.value) == conflict(*pair, "host").message.format(cache="first_block:0.1")


@pytest.mark.parametrize("component, refused", [("unet", True), ("text_encoder", False)])
def test_refuse_conflicts_keys_an_inpainting_backbone_on_the_loras_backbone_layers(component, refused):
    """A request's LoRA set on an inpainting backbone: refused (techniques_conflict, as before) when its feeds reach
    the backbone; a text-encoder-only set runs."""
    from types import SimpleNamespace

    from onnxdiffusion.adapters.feeds import AdapterFeeds
    from onnxdiffusion.serve.edits import refuse_conflicts
    from onnxdiffusion.serve.schemas import RequestError
    from onnxdiffusion.techniques.registry import conflict

    pipe = SimpleNamespace(resolve=lambda o: o, precision_schedule=None, backbone_extra_channels=lambda: 5,
                           family=SimpleNamespace(backbone="unet"))
    feeds = AdapterFeeds({component: {"a.lora_A": np.ones((2, 2), np.float32)}})
    req = SimpleNamespace(steps=4, sampler="euler", guidance=5.0, lora=SimpleNamespace(feeds=feeds))
    entry = SimpleNamespace(id="m", pipeline=pipe)
    if not refused:
        refuse_conflicts(entry, req, controlnet=False, inpaint=True)
        return
    with pytest.raises(RequestError) as e:
        refuse_conflicts(entry, req, controlnet=False, inpaint=True)
    assert e.value.code == "techniques_conflict" and str(e.value) == conflict("lora", "inpaint_backbone", "host").message
