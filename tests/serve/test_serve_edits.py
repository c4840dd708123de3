"""POST /v1/images/edits over HTTP (one `serve` subprocess, both embedded models, an API key): images equal the
library's `Pipeline(...)(prompt, image=, mask=, strength=, seed=)` bit for bit (openai client and httpx); bad input
gets 400/413 in OpenAI's error shape; the route needs the key. Test pictures are drawn here."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import CHROMEDRIVER, CHROMIUM, EMBEDDED, Server, assert_clean_error, decode_png  # noqa: E402
from test_serve_auth import BAD as BAD_KEYS  # noqa: E402

pytestmark = pytest.mark.slow

MMDIT = EMBEDDED.parent / "shapes-mmdit-onnx"
KEY = "edits-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
EDIT_BODY = 2 * 1024 * 1024  # the server's --max-edit-body here


def png(array: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def editing_server(model: str, folder, buckets: str):
    """A module's server of one editing model (Kontext, Qwen-Image-Edit): one worker, a generous timeout.
    Use as `yield from editing_server(...)` in a module-scoped fixture."""
    srv = Server({model: folder}, "--buckets", buckets, "--workers", "1", "--max-queue", "4", "--timeout", "300")
    yield srv
    srv.stop()


def edit_matches_the_library(server, folder, model: str, rgb: np.ndarray, height: int, width: int, **kw):
    """The openai client's `images.edit` of `rgb` on an editing model gives the library's
    `Pipeline(folder)(prompt, image=rgb, ...)` image bit for bit; returns the response for more checks."""
    openai = pytest.importorskip("openai")
    from onnxdiffusion.runtime import Pipeline

    prompt = "make the circle blue"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    resp = client.images.edit(image=("in.png", png(rgb), "image/png"), prompt=prompt, model=model,
                              size=f"{width}x{height}", response_format="b64_json", extra_body=kw)
    want = Pipeline.from_folder(folder, threads=1)(prompt, image=rgb, width=width, height=height, **kw).images
    np.testing.assert_array_equal(decode_png(base64.b64decode(resp.data[0].b64_json)), want[0])
    return resp


def scene(h: int = 70, w: int = 100) -> np.ndarray:
    rgb = np.full((h, w, 3), 96, np.uint8)
    rgb[h // 6 : h // 2, w // 10 : w // 3] = (220, 30, 30)
    rgb[h // 2 :, w // 2 : w // 2 + w // 8] = (30, 200, 60)
    return rgb


def openai_mask(h: int = 70, w: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(OpenAI's RGBA mask: the right half transparent, the library's: white = repaint)."""
    rgba = np.zeros((h, w, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:, w // 2 :, 3] = 0
    library = np.where(rgba[..., 3] < 128, 255, 0).astype(np.uint8)
    return rgba, library


@pytest.fixture(scope="module")
def server():
    srv = Server({"fp32": EMBEDDED, "mmdit": MMDIT}, "--buckets", "64x64,128x128", "--workers", "1",
                 "--max-queue", "8", "--timeout", "120", "--api-key", KEY, "--max-edit-body", "2M")
    srv.client.headers.update(HEADERS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pipes():
    from onnxdiffusion.runtime import Pipeline

    return {"fp32": Pipeline.from_folder(EMBEDDED, threads=1), "mmdit": Pipeline.from_folder(MMDIT, threads=1)}


def library(pipes, model: str, prompt: str, **kw) -> np.ndarray:
    return pipes[model](prompt, **kw).images  # in process (a resized picture warns)


def edit(server, files: dict, **fields):
    return server.client.post("/v1/images/edits", files=files, data={k: str(v) for k, v in fields.items()})


def test_openai_client_inpainting_matches_the_library(server, pipes):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    rgb, (rgba, lib_mask) = scene(), openai_mask()
    resp = client.images.edit(image=("scene.png", png(rgb), "image/png"), mask=("mask.png", png(rgba), "image/png"),
                              prompt="a blue circle on the right", model="fp32", response_format="b64_json",
                              extra_body={"steps": 6, "seed": 5})
    settings = resp.model_extra["settings"]
    assert settings["bucket"] == "64x64" and settings["requested_size"] == "100x70" and settings["image_size"] == "100x70"
    assert settings["strength"] == 1.0 and settings["mask"] == "mask" and settings["seed"] == 5
    assert "resized to 64x64" in resp.model_extra["notices"][0]
    want = library(pipes, "fp32", "a blue circle on the right", image=rgb, mask=lib_mask, strength=1.0, seed=5,
                   steps=6, width=64, height=64)
    np.testing.assert_array_equal(decode_png(base64.b64decode(resp.data[0].b64_json)), want[0])


def test_openai_client_img2img_on_the_mmdit_n2(server, pipes):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    rgb = scene(64, 64)
    resp = client.images.edit(image=("scene.png", png(rgb), "image/png"), prompt="a blue star", model="mmdit", n=2,
                              size="64x64", extra_body={"steps": 5, "seed": 9, "strength": 0.6})
    settings = resp.model_extra["settings"]
    assert settings["mask"] is None and settings["strength"] == 0.6 and settings["sampler"] == "flow_euler"
    assert "notices" not in resp.model_extra  # the picture was the bucket's size already
    want = library(pipes, "mmdit", "a blue star", image=rgb, strength=0.6, seed=9, steps=5, batch=2, width=64, height=64)
    assert len(resp.data) == 2
    for item, ref in zip(resp.data, want):
        np.testing.assert_array_equal(decode_png(base64.b64decode(item.b64_json)), ref)


def test_httpx_multipart_ancestral_sampler_size_and_url(server, pipes):
    """img2img with euler_a (ancestral noise drawn from the seed), an explicit size, a JPEG, the url format."""
    rgb = scene(90, 120)
    r = edit(server, {"image": ("scene.jpg", png(rgb, "JPEG"), "image/jpeg")}, prompt="a yellow triangle",
             model="fp32", size="128x128", steps=8, seed=21, sampler="euler_a", guidance=5.0, strength=0.7,
             negative_prompt="blurry", response_format="url")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["settings"]["bucket"] == "128x128" and body["settings"]["requested_size"] == "128x128"
    from PIL import Image

    picture = np.asarray(Image.open(io.BytesIO(png(rgb, "JPEG"))).convert("RGB"))
    want = library(pipes, "fp32", "a yellow triangle", negative_prompt="blurry", image=picture, strength=0.7, seed=21,
                   steps=8, sampler="euler_a", guidance=5.0, width=128, height=128)
    url = body["data"][0]["url"]
    assert url.startswith(server.url) and "b64_json" not in body["data"][0]
    got = decode_png(server.client.get(url[len(server.url):]).content)
    np.testing.assert_array_equal(got, want[0])
    assert server.client.get(f"/v1/jobs/{body['id']}").json()["status"] == "succeeded"  # a job like any other


def test_transparent_image_is_its_own_mask(server, pipes):
    rgb, (_, lib_mask) = scene(64, 64), openai_mask(64, 64)
    rgba = np.dstack([rgb, 255 - lib_mask])  # transparent where the mask repaints
    r = edit(server, {"image": ("cutout.png", png(rgba), "image/png")}, prompt="a blue circle", model="mmdit",
             steps=4, seed=2)
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["mask"] == "image alpha" and r.json()["settings"]["strength"] == 1.0
    want = library(pipes, "mmdit", "a blue circle", image=rgb, mask=lib_mask, strength=1.0, seed=2, steps=4)
    np.testing.assert_array_equal(decode_png(base64.b64decode(r.json()["data"][0]["b64_json"])), want[0])


def _bad_cases() -> list[tuple[str, dict, dict, str | None]]:
    rgb, (rgba, _) = scene(), openai_mask()
    img = {"image": ("a.png", png(rgb), "image/png")}
    truncated = png(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    return [
        ("not an image", {"image": ("a.png", b"hello, not a picture", "image/png")}, {"prompt": "x"}, "image"),
        ("empty file", {"image": ("a.png", b"", "image/png")}, {"prompt": "x"}, "image"),
        ("truncated png", {"image": ("a.png", truncated[: len(truncated) // 2], "image/png")}, {"prompt": "x"}, "image"),
        ("gif", {"image": ("a.gif", png(rgb, "GIF"), "image/gif")}, {"prompt": "x"}, "image"),
        ("too wide", {"image": ("a.png", png(np.zeros((1, 5000, 3), np.uint8)), "image/png")}, {"prompt": "x"}, "image"),
        ("mask no alpha", {**img, "mask": ("m.png", png(rgb), "image/png")}, {"prompt": "x"}, "mask"),
        ("mask size", {**img, "mask": ("m.png", png(rgba[:60]), "image/png")}, {"prompt": "x"}, "mask"),
        ("opaque mask", {**img, "mask": ("m.png", png(np.full((70, 100, 4), 255, np.uint8)), "image/png")},
         {"prompt": "x"}, "mask"),
        ("bad mask file", {**img, "mask": ("m.png", b"\x89PNG\r\n\x1a\nnope", "image/png")}, {"prompt": "x"}, "mask"),
        ("strength 0", img, {"prompt": "x", "strength": "0"}, "strength"),
        ("strength 1.5", img, {"prompt": "x", "strength": "1.5"}, "strength"),
        ("strength nan", img, {"prompt": "x", "strength": "nan"}, "strength"),
        ("strength word", img, {"prompt": "x", "strength": "half"}, "strength"),
        ("no step left", img, {"prompt": "x", "strength": "0.1", "steps": "4"}, "strength"),
        ("missing prompt", img, {"steps": "2"}, "prompt"),
        ("empty prompt", img, {"prompt": "  "}, "prompt"),
        ("missing image", {}, {"prompt": "x"}, "image"),
        ("image as text", {}, {"prompt": "x", "image": "a.png"}, "image"),
        ("prompt as file", {**img, "prompt": ("p.txt", b"x", "text/plain")}, {}, "prompt"),
        ("unknown field", img, {"prompt": "x", "colour": "red"}, "colour"),
        ("preview", img, {"prompt": "x", "preview": "true"}, "preview"),
        ("n word", img, {"prompt": "x", "n": "two"}, "n"),
        ("n too many", img, {"prompt": "x", "n": "9"}, "n"),
        ("bad size", img, {"prompt": "x", "size": "big"}, "size"),
        ("beyond the mmdit", img, {"prompt": "x", "model": "mmdit", "size": "128x128"}, "size"),
        ("unknown model", img, {"prompt": "x", "model": "nope"}, "model"),
        ("bad format", img, {"prompt": "x", "response_format": "gif"}, "response_format"),
        ("flow sampler on sd", img, {"prompt": "x", "sampler": "flow_euler"}, "sampler"),
    ]


def raw_multipart(fields: dict[str, str]) -> dict:
    """A multipart body of text parts only (httpx sends a body without files urlencoded)."""
    parts = b"".join(f'--xyz\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                     for k, v in fields.items())
    return {"content": parts + b"--xyz--\r\n", "headers": {"content-type": "multipart/form-data; boundary=xyz"}}


def test_bad_input_is_a_clean_4xx(server):
    for name, files, data, param in _bad_cases():
        if files:
            r = server.client.post("/v1/images/edits", files=files, data=data)
        else:
            r = server.client.post("/v1/images/edits", **raw_multipart(data))
        body = assert_clean_error(r, 400, param)
        assert "\n" not in body["error"]["message"], (name, body)
    two = [("image", ("a.png", png(scene()), "image/png")), ("image", ("b.png", png(scene()), "image/png"))]
    assert_clean_error(server.client.post("/v1/images/edits", files=two, data={"prompt": "x"}), 400, "image")
    as_json = server.client.post("/v1/images/edits", json={"prompt": "x", "image": "aGVsbG8="})
    assert assert_clean_error(as_json, 400)["error"]["code"] == "invalid_body"
    garbled = server.client.post("/v1/images/edits", content=b"--nope\r\n\r\n",
                                 headers={"content-type": "multipart/form-data"})  # no boundary
    assert_clean_error(garbled, 400)
    assert server.client.get("/health").json() == {"status": "ok"}


def test_upload_limits(server, pipes):
    noise = np.random.default_rng(1).integers(0, 255, (256, 256, 3), dtype=np.uint8)
    data = png(noise)
    assert 64 * 1024 < len(data) < EDIT_BODY  # over the JSON routes' limit, under the edit route's
    r = edit(server, {"image": ("noise.png", data, "image/png")}, prompt="a red circle", steps=4, seed=1, strength=0.5)
    assert r.status_code == 200, r.text
    assert "resized to 128x128" in r.json()["notices"][0]  # the bucket nearest 256x256
    want = library(pipes, "fp32", "a red circle", image=noise, strength=0.5, seed=1, steps=4, width=128, height=128)
    np.testing.assert_array_equal(decode_png(base64.b64decode(r.json()["data"][0]["b64_json"])), want[0])
    big = np.random.default_rng(2).integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    r = edit(server, {"image": ("big.png", png(big), "image/png")}, prompt="x")
    assert assert_clean_error(r, 413)["error"]["code"] == "body_too_large"
    assert str(EDIT_BODY) in r.json()["error"]["message"]
    chunked = server.client.post("/v1/images/edits", content=iter([b"--b\r\n"] + [b"z" * 65536] * 40),
                                 headers={"content-type": "multipart/form-data; boundary=b"})  # counted while read
    assert_clean_error(chunked, 413)
    # the JSON routes keep their small limit
    assert_clean_error(server.client.post("/v1/images/generations", json={"prompt": "x" * 100_000}), 413)


@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_the_route_needs_the_key(server, case):
    headers, code = BAD_KEYS[case]
    with httpx.Client(base_url=server.url, timeout=60) as bare:  # without the fixture's key header
        r = bare.post("/v1/images/edits", headers=headers, files={"image": ("a.png", png(scene()), "image/png")},
                      data={"prompt": "a red circle"})
    assert r.status_code == 401 and r.json()["error"]["code"] == code, r.text
    assert KEY not in r.text


def test_an_unauthenticated_upload_is_refused_before_it_is_read(server):
    with httpx.Client(base_url=server.url, timeout=60) as bare:
        r = bare.post("/v1/images/edits", content=b"x" * (5 * 1024 * 1024),
                      headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_openapi_documents_the_route(server):
    op = server.client.get("/openapi.json").json()["paths"]["/v1/images/edits"]["post"]
    schema = op["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"image", "mask", "prompt", "strength", "seed", "steps"} <= set(schema["properties"])


@pytest.mark.browser
@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason="/usr/bin/chromium or chromedriver not installed (bash bench/install_chromium.sh)")
def test_page_uploads_a_picture_in_headless_chromium(server, pipes, tmp_path):
    pytest.importorskip("selenium.webdriver")
    from onnxdiffusion.web.browser import chrome
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    rgb = scene()
    picture = tmp_path / "scene.png"
    picture.write_bytes(png(rgb))
    driver = chrome()  # onnxdiffusion.web.browser's headless Chromium
    try:
        wait = WebDriverWait(driver, 90, poll_frequency=0.05)
        driver.get(server.url + "/")
        driver.find_element(By.ID, "apikey").send_keys(KEY)
        driver.find_element(By.ID, "savekey").click()
        wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
        Select(driver.find_element(By.ID, "model")).select_by_value("fp32")
        for name, value in (("prompt", "a blue circle"), ("steps", "6"), ("seed", "4"), ("strength", "0.75")):
            field = driver.find_element(By.ID, name)
            field.clear()
            field.send_keys(value)
        driver.find_element(By.ID, "image").send_keys(str(picture))
        driver.find_element(By.ID, "submit").click()
        card = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".job"))[0]
        wait.until(lambda d: card.get_attribute("data-status") == "succeeded")
        assert "resized to 64x64" in card.get_attribute("data-edit")
        img = card.find_element(By.CSS_SELECTOR, "img.result")
        wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 64)
        got = decode_png(base64.b64decode(img.get_attribute("src").split(",", 1)[1]))
        want = library(pipes, "fp32", "a blue circle", image=rgb, strength=0.75, seed=4, steps=6, width=64, height=64)
        np.testing.assert_array_equal(got, want[0])
    finally:
        driver.quit()
