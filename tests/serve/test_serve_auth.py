"""API keys over real HTTP: a `serve` subprocess with keys from all three sources (flag, file, env).

Missing, wrong and non-Bearer keys get 401 in OpenAI's error shape on every API and job route (SSE
included); the right key works through httpx and the openai client; jobs are private to their key;
one key's backlog is bounded (429) and cannot starve another key; the web page sends the key.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

from onnxdiffusion.errors import UserError  # noqa: E402

from test_serve import CHROMEDRIVER, CHROMIUM, EMBEDDED, Server  # noqa: E402

KEY_FLAG, KEY_FILE, KEY_ENV = "flag-key-0123456789", "file-key-abcdefghij", "env-key-ZYXWVUTSRQ"
MMDIT = EMBEDDED.parent / "shapes-mmdit-onnx"


def test_read_keys_sources_and_checks(tmp_path):
    from onnxdiffusion.serve.auth import KeyRing, read_keys

    f = tmp_path / "keys"
    f.write_text(f"# team keys\n{KEY_FILE}\n\n{KEY_FLAG}\n")
    keys = read_keys((KEY_FLAG,), f, environ={"ONNXDIFFUSION_API_KEYS": f"{KEY_ENV}, {KEY_FILE}"})
    assert keys == (KEY_FLAG, KEY_FILE, KEY_ENV)  # order kept, duplicates dropped
    ring = KeyRing(keys)
    assert [ring.caller(k) for k in keys] == ["key-1", "key-2", "key-3"]
    assert ring.caller(KEY_FLAG + "x") is None and ring.caller(KEY_FLAG[:-1]) is None and ring.caller("") is None
    with pytest.raises(UserError, match="8..512"):
        read_keys(("short",), environ={})
    with pytest.raises(UserError, match="cannot read"):
        read_keys((), tmp_path / "absent", environ={})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(UserError, match="holds no key"):
        read_keys((), tmp_path / "empty", environ={})


class KeyServer(Server):
    def __init__(self, models, *extra, env_keys: str = KEY_ENV):
        os.environ["ONNXDIFFUSION_API_KEYS"] = env_keys
        try:
            super().__init__(models, *extra)
        finally:
            del os.environ["ONNXDIFFUSION_API_KEYS"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(KEY_FILE + "\n")
    srv = KeyServer({"fp32": EMBEDDED, "mmdit": MMDIT}, "--buckets", "64x64,128x128", "--workers", "1",
                    "--max-queue", "8", "--key-max-jobs", "2", "--api-key", KEY_FLAG, "--api-key-file", str(keyfile))
    yield srv
    srv.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/fp32"), ("POST", "/v1/images/generations"), ("POST", "/v1/jobs"),
          ("GET", "/v1/jobs/abc"), ("GET", "/v1/jobs/abc/result"), ("GET", "/v1/jobs/abc/images/0"),
          ("GET", "/v1/jobs/abc/events"), ("DELETE", "/v1/jobs/abc"), ("POST", "/v1/models/fp32/check"),
          ("GET", "/metrics")]
BAD = {"missing": ({}, "missing_api_key"), "wrong": (auth("wrong-key-0123456789"), "invalid_api_key"),
       # basic auth (A1111's clients) takes a key as its password: a wrong one is refused as a wrong key
       "basic": ({"Authorization": "Basic " + base64.b64encode(b"user:wrong-key-0123456789").decode()},
                 "invalid_api_key"),
       "digest": ({"Authorization": f"Digest {KEY_FLAG}"}, "invalid_authorization_scheme"),
       "bare": ({"Authorization": KEY_FLAG}, "invalid_authorization_scheme"),
       "empty-bearer": ({"Authorization": "Bearer"}, "invalid_authorization_scheme"),
       "prefix": (auth(KEY_FLAG[:-1]), "invalid_api_key"), "longer": (auth(KEY_FLAG + "0"), "invalid_api_key")}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("method,path", ROUTES)
def test_refused_keys_get_401_in_openai_shape(keyed, method, path, case):
    headers, code = BAD[case]
    r = keyed.client.request(method, path, headers=headers, json={"prompt": "a red circle"})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == code and KEY_FLAG not in r.text


def test_open_routes_need_no_key(keyed):
    for path in ("/health", "/ready", "/", "/openapi.json"):
        assert keyed.client.get(path).status_code == 200, path
    assert "apikey" in keyed.client.get("/").text  # the page has its key field


def test_an_unauthenticated_large_body_is_refused_before_it_is_read(keyed):
    r = keyed.client.post("/v1/jobs", content=b"x" * (200 * 1024), headers={"Content-Type": "application/json"})
    assert r.status_code == 401


@pytest.mark.parametrize("key", [KEY_FLAG, KEY_FILE, KEY_ENV])
def test_each_key_source_works_with_the_openai_client(keyed, key):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, timeout=120)
    out = client.images.generate(model="fp32", prompt="a red circle", n=1, size="64x64", extra_body={"steps": 2})
    assert out.data[0].b64_json
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong-key-0123456789", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.images.generate(model="fp32", prompt="a red circle", size="64x64")
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"


def test_sse_progress_with_key_and_jobs_private_to_their_key(keyed):
    c = keyed.client
    job = c.post("/v1/jobs", headers=auth(KEY_FLAG), json={"prompt": "a blue star", "steps": 6, "model": "mmdit"}).json()
    for other in (KEY_FILE, KEY_ENV):  # another key sees no such job
        for method, path in (("GET", ""), ("GET", "/events"), ("GET", "/result"), ("DELETE", "")):
            r = c.request(method, f"/v1/jobs/{job['id']}{path}", headers=auth(other))
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (method, path, r.text)
    with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=auth(KEY_FLAG)) as r:
        assert r.status_code == 200
        kinds, last = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            if kinds and kinds[-1] == "done" and line.startswith("data: "):
                import json

                last = json.loads(line[6:])
                break
    assert kinds[-1] == "done" and last["status"] == "succeeded" and kinds.count("progress") >= 1
    assert c.get(f"/v1/jobs/{job['id']}/images/0", headers=auth(KEY_FLAG)).headers["content-type"] == "image/png"


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_per_key_limit_and_no_starvation(keyed):
    c = keyed.client
    body = {"prompt": "a red circle", "steps": 60, "size": "128x128", "model": "fp32"}
    a1 = c.post("/v1/jobs", headers=auth(KEY_FLAG), json=body).json()
    a2 = c.post("/v1/jobs", headers=auth(KEY_FLAG), json={**body, "steps": 61}).json()  # not batchable with a1
    r = c.post("/v1/jobs", headers=auth(KEY_FLAG), json=body)  # a third from the same key: over its share
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers
    b1 = c.post("/v1/jobs", headers=auth(KEY_FILE), json={**body, "steps": 2, "size": "64x64"})
    assert b1.status_code == 202, b1.text  # another key is not blocked by the first one's backlog
    b1 = b1.json()
    status = lambda j, k: c.get(f"/v1/jobs/{j['id']}", headers=auth(k)).json()  # noqa: E731
    _wait(lambda: status(b1, KEY_FILE)["status"] == "succeeded", 300)
    # one worker: a1 ran first; b1 (queued after a2) ran before a2, because its key had nothing running
    assert status(a2, KEY_FLAG)["started"] is None or status(a2, KEY_FLAG)["started"] >= status(b1, KEY_FILE)["started"]
    for j in (a1, a2):
        c.delete(f"/v1/jobs/{j['id']}", headers=auth(KEY_FLAG))
    _wait(lambda: all(status(j, KEY_FLAG)["status"] in ("cancelled", "succeeded") for j in (a1, a2)))


def test_metrics_can_be_left_open():
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    for protect, want in ((True, 401), (False, 200)):
        config = ServeConfig(models=(str(EMBEDDED),), buckets="64x64", workers=1, warmup=False,
                             api_keys=(KEY_FLAG,), protect_metrics=protect)
        with TestClient(create_app(config)) as client:
            assert client.get("/metrics").status_code == want
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models", headers=auth(KEY_FLAG)).status_code == 200
    assert "key" not in repr(config).lower().replace("key_max_jobs", "")  # keys stay out of reprs and logs


@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason="/usr/bin/chromium or chromedriver not installed (bash bench/install_chromium.sh)")
def test_web_page_sends_the_key(keyed, tmp_path):
    pytest.importorskip("selenium.webdriver")
    from onnxdiffusion.web.browser import chrome
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = chrome()  # onnxdiffusion.web.browser's headless Chromium
    try:
        wait = WebDriverWait(driver, 120, poll_frequency=0.05)
        driver.get(keyed.url + "/")
        wait.until(lambda d: "needs an API key" in d.find_element(By.ID, "ready").text)
        driver.find_element(By.ID, "apikey").send_keys(KEY_ENV)
        driver.find_element(By.ID, "savekey").click()
        wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
        Select(driver.find_element(By.ID, "model")).select_by_value("mmdit")
        assert [o.text for o in Select(driver.find_element(By.ID, "size")).options] == ["64x64"]  # its own buckets
        steps = driver.find_element(By.ID, "steps")
        steps.clear()
        steps.send_keys("8")
        driver.find_element(By.ID, "submit").click()
        card = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".job"))[0]
        wait.until(lambda d: card.get_attribute("data-status") == "succeeded")
        assert int(card.get_attribute("data-events")) >= 2  # progress arrived over the keyed stream
        img = card.find_element(By.CSS_SELECTOR, "img.result")
        wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 64)
        assert driver.execute_script("return sessionStorage.getItem('onnxdiffusion-api-key')") == KEY_ENV
        driver.save_screenshot(str(tmp_path / "page_with_key.png"))
    finally:
        driver.quit()
