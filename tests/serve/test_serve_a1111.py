"""AUTOMATIC1111's API (`/sdapi/v1`), driven by the `webuiapi` client (PyPI) as its README uses it, against a server
subprocess serving both embedded models with no --buckets and the shipped LoRA adapters (`--lora-dir models/loras`)
on the plain SD export (its insertion points derived at start-up).

Images equal the library's (`Pipeline(folder)(...)`, what `generate` runs) for the same settings, bit for bit: the
path is the same. Models switch through `options`; progress shows a step preview; interrupt ends a run; a LoRA named
by `<lora:NAME:WEIGHT>` in the prompt gives the `lora` field's image; bad input is a 4xx in A1111's error shape and
the server keeps serving. Last, `serve` with no flags on the MMDiT alone and on both embedded models.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli_here

pytest.importorskip("fastapi", reason="the serve extra is not installed")
webuiapi = pytest.importorskip("webuiapi", reason="webuiapi (the dev extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import EMBEDDED, ROOT, Server, _env, _free_port  # noqa: E402

MMDIT = ROOT / "models" / "shapes-mmdit-onnx"
LORAS = ROOT / "models" / "loras"
VIOLET = LORAS / "shapes-sd-violet.safetensors"


@pytest.fixture(scope="module")
def server():
    srv = Server({"sd": EMBEDDED, "mmdit": MMDIT}, "--workers", "1", "--lora-dir", str(LORAS), "--timeout", "120")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server):
    client = webuiapi.WebUIApi(host="127.0.0.1", port=server.port)
    client.util_set_model("sd")
    return client


@pytest.fixture(scope="module")
def pipes():
    from onnxdiffusion.runtime import Pipeline

    return {"sd": Pipeline.from_folder(EMBEDDED, threads=1), "mmdit": Pipeline.from_folder(MMDIT, threads=1)}


def arr(img) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


@pytest.mark.slow
def test_txt2img_equals_the_library_seeds_and_samplers(api, pipes):
    # webuiapi's defaults: sampler "Euler a" (sent as sampler_name and sampler_index), scheduler "automatic", eta 1
    r = api.txt2img(prompt="a red circle on the left", seed=5, steps=6, cfg_scale=4.0, width=64, height=64)
    want = pipes["sd"]("a red circle on the left", seed=5, steps=6, guidance=4.0, sampler="euler_a").images[0]
    np.testing.assert_array_equal(arr(r.image), want)
    assert r.info["sampler_name"] == "Euler a" and r.info["onnxdiffusion"]["sampler"] == "euler_a"
    assert r.info["seed"] == 5 and r.info["sd_model_name"] == "sd"
    # A1111's seeds: image i of a request takes seed + i, all listed in info
    r = api.txt2img(prompt="a blue star", seed=11, steps=5, cfg_scale=4.0, width=64, height=64, sampler_name="DDIM",
                    batch_size=2)
    assert r.info["all_seeds"] == [11, 12] and len(r.images) == 2
    for img, seed in zip(r.images, (11, 12)):
        np.testing.assert_array_equal(arr(img), pipes["sd"]("a blue star", seed=seed, steps=5, guidance=4.0,
                                                            sampler="ddim").images[0])
    # seed -1: random, and the seed it used gives the same image again
    r = api.txt2img(prompt="a green square", seed=-1, steps=4, width=64, height=64, sampler_name="DDIM")
    used = r.info["seed"]
    assert 0 <= used < 2**32
    again = api.txt2img(prompt="a green square", seed=used, steps=4, width=64, height=64, sampler_name="DDIM")
    np.testing.assert_array_equal(arr(r.image), arr(again.image))


@pytest.mark.slow
def test_models_listed_and_switched_through_options(api, pipes):
    assert api.util_get_model_names() == ["mmdit", "sd"]
    api.util_set_model("mmdit")
    try:
        assert api.util_get_current_model() == "mmdit"
        # "Euler" on a flow-matching model is its flow Euler; size left out: the model's trained 64x64
        r = api.txt2img(prompt="a yellow triangle", seed=2, steps=5, cfg_scale=3.0, sampler_name="Euler",
                        width=None, height=None)
        want = pipes["mmdit"]("a yellow triangle", seed=2, steps=5, guidance=3.0, sampler="flow_euler").images[0]
        np.testing.assert_array_equal(arr(r.image), want)
        assert r.info["onnxdiffusion"]["model"] == "mmdit" and r.info["onnxdiffusion"]["sampler"] == "flow_euler"
        # override_settings names a model for one request only
        r = api.txt2img(prompt="a red ring", seed=1, steps=3, width=64, height=64, sampler_name="DDIM",
                        override_settings={"sd_model_checkpoint": "sd"})
        assert r.info["sd_model_name"] == "sd"
        assert api.util_get_current_model() == "mmdit"
    finally:
        api.util_set_model("sd")
    assert api.util_get_current_model() == "sd"
    names = api.util_get_sampler_names()
    assert {"Euler a", "Euler", "DDIM", "DPM++ 2M"} <= set(names)
    assert api.util_get_scheduler_names() == ["automatic"]
    assert api.get_upscalers() == [] and {x["name"] for x in api.get_loras()} == {"shapes-sd-lcm", "shapes-sd-violet"}


@pytest.mark.slow
def test_img2img_and_inpainting_equal_the_library(api, pipes):
    from PIL import Image

    pipe = pipes["sd"]
    start = pipe("a red circle on the left", seed=0, steps=8).images[0]
    picture = Image.fromarray(start)
    # A1111 runs int(steps * strength) steps, as the library (and diffusers) do
    r = api.img2img(images=[picture], prompt="a blue circle on the left", seed=4, steps=10, denoising_strength=0.6,
                    cfg_scale=4.0, width=64, height=64, sampler_name="DDIM")
    want = pipe("a blue circle on the left", image=start, strength=0.6, seed=4, steps=10, guidance=4.0,
                sampler="ddim").images[0]
    np.testing.assert_array_equal(arr(r.image), want)
    assert r.info["denoising_strength"] == 0.6
    r = api.img2img(images=[picture], prompt="a blue circle on the left", seed=4, steps=10, denoising_strength=0.6,
                    cfg_scale=4.0, width=64, height=64, sampler_name="DDIM", batch_size=2)
    np.testing.assert_array_equal(arr(r.images[0]), want)  # each image renders alone, seed + i
    np.testing.assert_array_equal(arr(r.images[1]), pipe("a blue circle on the left", image=start, strength=0.6,
                                                         seed=5, steps=10, guidance=4.0, sampler="ddim").images[0])
    mask = np.zeros((64, 64), np.uint8)
    mask[8:40, 24:56] = 255  # white: repaint (A1111's convention, the library's too)
    # webuiapi's default mask_blur (4) is the library's mask_blur
    r = api.img2img(images=[picture], mask_image=Image.fromarray(mask), prompt="a yellow star", seed=9, steps=8,
                    denoising_strength=0.9, cfg_scale=4.0, width=64, height=64, sampler_name="DDIM")
    want = pipe("a yellow star", image=start, mask=mask, mask_blur=4.0, strength=0.9, seed=9, steps=8, guidance=4.0,
                sampler="ddim").images[0]
    np.testing.assert_array_equal(arr(r.image), want)


@pytest.mark.slow
def test_lora_tag_equals_the_lora_field(api, server, pipes):
    prompt = "a violet star left of a red star"
    r = api.txt2img(prompt=f"{prompt} <lora:shapes-sd-violet:0.8>", seed=3, steps=6, cfg_scale=4.0, width=64,
                    height=64, sampler_name="DDIM")
    assert r.info["prompt"] == prompt and r.info["onnxdiffusion"]["lora"] == [{"name": "shapes-sd-violet",
                                                                                "scale": 0.8}]
    field = server.client.post("/v1/images/generations", json={"prompt": prompt, "model": "sd", "seed": 3, "steps": 6,
                                                               "guidance": 4.0, "sampler": "ddim", "size": "64x64",
                                                               "lora": ["shapes-sd-violet:0.8"]})
    assert field.status_code == 200, field.text
    from PIL import Image

    by_field = np.asarray(Image.open(io.BytesIO(base64.b64decode(field.json()["data"][0]["b64_json"]))).convert("RGB"))
    np.testing.assert_array_equal(arr(r.image), by_field)
    # and the OpenAI route reads the tag too
    tagged = server.client.post("/v1/images/generations", json={
        "prompt": f"{prompt} <lora:shapes-sd-violet:0.8>", "model": "sd", "seed": 3, "steps": 6, "guidance": 4.0,
        "sampler": "ddim", "size": "64x64"})
    assert tagged.status_code == 200, tagged.text
    assert tagged.json()["data"][0]["b64_json"] == field.json()["data"][0]["b64_json"]
    plain = pipes["sd"](prompt, seed=3, steps=6, guidance=4.0, sampler="ddim").images[0]
    assert not np.array_equal(plain, by_field)


@pytest.mark.slow
def test_progress_preview_and_interrupt(api):
    out: dict = {}

    def run():
        try:
            out["result"] = api.txt2img(prompt="a large green triangle", seed=1, steps=100, width=128, height=128,
                                        sampler_name="DDIM", batch_size=2)
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120
    seen = None
    while time.monotonic() < deadline:
        p = api.get_progress()
        if p["state"]["sampling_step"] >= 2 and p["current_image"]:
            seen = p
            break
        time.sleep(0.05)
    assert seen is not None, "no progress with a preview"
    assert 0 < seen["progress"] < 1 and seen["state"]["job_count"] == 2 and seen["state"]["sampling_steps"] == 100
    from PIL import Image

    assert Image.open(io.BytesIO(base64.b64decode(seen["current_image"]))).size[0] <= 64
    t0 = time.monotonic()
    api.interrupt()
    t.join(60)
    assert not t.is_alive() and "error" not in out, out
    stopped = time.monotonic() - t0
    assert out["result"].info["onnxdiffusion"]["interrupted"] is True and out["result"].images == []
    assert stopped < 10, stopped
    assert api.get_progress()["state"]["job_count"] == 0


def _png(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow
def test_bad_input_is_a_4xx_in_a1111_shape_and_the_server_keeps_serving(server):
    from PIL import Image

    small = _png(Image.new("RGB", (64, 64), "red"))
    txt = {"prompt": "a red circle", "steps": 2, "width": 64, "height": 64, "sampler_name": "DDIM"}
    img = {**txt, "init_images": [small]}
    cases = [
        ("txt2img", {**txt, "sampler_name": "Ancestral Wobble"}, 404, "sampler_not_found"),
        ("txt2img", {**txt, "scheduler": "karras"}, 422, "scheduler_not_found"),
        ("img2img", {**img, "init_images": ["not base64 at all!"]}, 422, "invalid_base64"),
        ("img2img", {**img, "init_images": [base64.b64encode(b"no picture").decode()]}, 422, "invalid_image"),
        ("img2img", {**img, "init_images": [_png(Image.new("L", (5000, 8)))]}, 413, "image_too_large"),
        ("img2img", {**img, "mask": _png(Image.new("L", (32, 32), 255))}, 422, "mask_size_mismatch"),
        ("img2img", {**img, "denoising_strength": 1.5}, 422, None),
        ("txt2img", {**txt, "prompt": "x <lora:no-such-adapter:1>"}, 422, "lora_not_found"),
        ("txt2img", {**txt, "prompt": "x <lora:shapes-sd-violet:9>"}, 422, "invalid_lora_tag"),
        ("txt2img", {**txt, "prompt": "x <lora:shapes-sd-violet:1:0.5>"}, 422, "invalid_lora_tag"),
        ("txt2img", {**txt, "steps": 0}, 422, None),
        ("txt2img", {**txt, "enable_hr": True}, 422, "unsupported_field"),
        ("txt2img", {**txt, "override_settings": {"sd_model_checkpoint": "nope"}}, 422, "model_not_found"),
    ]
    for route, body, status, code in cases:
        r = server.client.post(f"/sdapi/v1/{route}", json=body)
        assert r.status_code == status, (body.get("prompt"), code, r.text[:300])
        err = r.json()
        assert set(err) >= {"error", "detail", "body", "errors"} and err["code"] == code, err
        assert "Traceback" not in r.text and str(ROOT) not in r.text
    r = server.client.post("/sdapi/v1/txt2img", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_json"
    r = server.client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "nope"})
    assert r.status_code == 422 and r.json()["code"] == "model_not_found"
    r = server.client.post("/sdapi/v1/txt2img", json=txt)
    assert r.status_code == 200 and len(r.json()["images"]) == 1
    assert server.client.get("/ready").status_code == 200


def test_basic_auth_and_bearer_both_take_a_key():
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    key = "a1111-key-0123456789"
    config = ServeConfig(models=(f"sd={EMBEDDED}",), workers=1, warmup=False, api_keys=(key,))
    with TestClient(create_app(config)) as c:
        assert c.get("/sdapi/v1/sd-models").status_code == 401
        assert c.get("/sdapi/v1/sd-models", auth=("anyone", key)).status_code == 200
        assert c.get("/sdapi/v1/sd-models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        wrong = c.get("/sdapi/v1/sd-models", auth=("anyone", "wrong-key-0123456789"))
        assert wrong.status_code == 401 and key not in wrong.text


def _serve_no_flags(*folders: Path, timeout: float = 240) -> tuple[float, dict]:
    """`onnxdiffusion serve FOLDER...` with no other flag (but a free port): seconds to ready, and /v1/models."""
    port = _free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "onnxdiffusion.cli", "serve", *map(str, folders), "--port", str(port)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while time.monotonic() - t0 < timeout:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if client.get("/ready").status_code == 200:
                        return time.monotonic() - t0, client.get("/v1/models").json()
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise AssertionError("server did not become ready")
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_serve_with_no_flags_serves_any_embedded_model():
    seconds, models = _serve_no_flags(MMDIT)
    assert [m["buckets"] for m in models["data"]] == [["64x64"]] and models["buckets"] == ["64x64"]
    print(f"mmdit alone: ready in {seconds:.1f}s")
    seconds, models = _serve_no_flags(EMBEDDED, MMDIT)
    by_id = {m["id"]: m for m in models["data"]}
    assert by_id["shapes-sd-onnx"]["buckets"][0] == "64x64" and len(by_id["shapes-sd-onnx"]["buckets"]) == 5
    assert by_id["shapes-mmdit-onnx"]["buckets"] == ["64x64"]
    print(f"both: ready in {seconds:.1f}s")
    # an explicit --buckets that fits no served model is still an error (in-process: refused before serving)
    proc = run_cli_here("serve", MMDIT, "--buckets", "128x128", "--port", _free_port(), timeout=120)
    assert proc.returncode != 0 and "128x128" in proc.stderr and "Traceback" not in proc.stderr


def test_info_is_json_text():
    from onnxdiffusion.serve.a1111_schemas import Txt2ImgBody, info_text
    from onnxdiffusion.serve.job_request import JobRequest

    req = JobRequest(prompt="p", negative_prompt="", n=1, width=64, height=64, steps=3, sampler="euler_a", guidance=4.0,
                     seed=7, model="sd", model_requested="sd", fallback=False, requested_size="64x64")
    info = json.loads(info_text([req], Txt2ImgBody(), None, "sd", {}))
    assert info["sampler_name"] == "Euler a" and info["all_seeds"] == [7] and "Seed: 7" in info["infotexts"][0]


def test_tags_are_split_and_tidied():
    from onnxdiffusion.adapters.tags import LoraTagError, split_tags

    assert split_tags("a red circle <lora:style:0.8>") == ("a red circle", [("style", 0.8)])
    assert split_tags("<lora:a> a, <lora:b:-1>, star") == ("a, star", [("a", 1.0), ("b", -1.0)])
    assert split_tags("no  tag, kept as is ") == ("no  tag, kept as is ", [])
    for bad in ("x <lora::1>", "x <lora:a:1:2>", "x <lora:a:zz>", "x <lora:a:4.5>", "<lora:a><lora:a:2>",
                "<lora:a:nan>"):
        with pytest.raises(LoraTagError):
            split_tags(bad)


@pytest.mark.slow
def test_generate_reads_tags_and_derives_points_once(tmp_path, monkeypatch):
    """`generate PLAIN "... <lora:NAME:W>"` equals `--lora FILE:W`; the points copy is derived once and said once."""
    from cli_helpers import assert_one_line_error, invoke
    from PIL import Image

    from onnxdiffusion.adapters.folder import with_points

    cache = tmp_path / "cache"
    monkeypatch.setenv("ONNXDIFFUSION_CACHE", str(cache))
    common = ["--steps", "4", "--seed", "2", "--sampler", "ddim"]
    first = invoke("generate", EMBEDDED, "a violet star <lora:shapes-sd-violet:0.7>", *common, "-o", tmp_path / "tag.png")
    assert first.returncode == 0 and "deriving a copy" in first.stderr, first.stderr
    second = invoke("generate", EMBEDDED, "a violet star", "--lora", f"{VIOLET}:0.7", *common, "-o", tmp_path / "f.png")
    assert second.returncode == 0 and "deriving" not in second.stderr, second.stderr
    said: list = []
    assert with_points(EMBEDDED, log=said.append).parent.parent == cache and said == []
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "tag.png")), np.asarray(Image.open(tmp_path / "f.png")))
    assert_one_line_error(invoke("generate", EMBEDDED, "x <lora:nope>", "-o", tmp_path / "bad.png"), "<lora:nope>")
    assert_one_line_error(invoke("generate", EMBEDDED, "x <lora:a:1:2>", "-o", tmp_path / "bad.png"), "one weight")


def test_not_ready_is_a_503_with_retry_after_on_both_apis(monkeypatch):
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import Service, create_app
    from onnxdiffusion.serve.config import ServeConfig

    monkeypatch.setattr(Service, "start", lambda self: None)  # warm-up never ends
    with TestClient(create_app(ServeConfig(models=(str(EMBEDDED),), workers=1))) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a red circle"})
        assert r.status_code == 503 and r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "not_ready"
        r = c.post("/sdapi/v1/txt2img", json={"prompt": "a red circle"})
        assert r.status_code == 503 and r.headers["retry-after"] == "2" and r.json()["code"] == "not_ready"
