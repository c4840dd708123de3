"""The HTTP service, over real HTTP: a server subprocess on a free loopback port.

Three models are served: the embedded fp32 model, an int8 copy made here with `quantize`, and a
deliberately broken int8 copy (its quantized weights scrambled) that the golden check must catch
and route to fp32. Images are compared with the in-process `Pipeline` run with the same settings.
The web page is driven in headless Chromium (skipped with a reason when Chromium is absent).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
EMBEDDED = ROOT / "models" / "shapes-sd-onnx"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def break_backbone(folder: Path) -> None:
    """Scramble every 8-bit weight of the quantized backbone; keep the folder loadable (hash updated)."""
    import onnx
    from onnx import numpy_helper

    from onnxdiffusion.folder.artifacts import sha256_file

    path = folder / "unet" / "model.onnx"
    model = onnx.load(str(path))
    rng = np.random.default_rng(0)
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype in (np.uint8, np.int8) and arr.size > 64:
            init.CopyFrom(numpy_helper.from_array(rng.permutation(arr.ravel()).reshape(arr.shape), init.name))
    onnx.save(model, str(path))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["unet/model.onnx"] = sha256_file(path)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.fixture(scope="session")
def serve_models(tmp_path_factory) -> dict[str, Path]:
    from conftest import shared_folder

    def build(root: Path) -> Path:
        from cli_helpers import run_cli_here  # the verb in-process: no interpreter (and torch import) of its own

        proc = run_cli_here("quantize", EMBEDDED, root / "int8", "--recipe", "int8-dynamic", "--calib-count", 4,
                            "--calib-steps", 4, "--latency-runs", 2)
        assert proc.returncode == 0, proc.stderr[-2000:]
        shutil.copytree(root / "int8", root / "broken")
        break_backbone(root / "broken")
        return root

    root = shared_folder(tmp_path_factory, "serve_models", build)  # once per run, not once per xdist worker
    return {"fp32": EMBEDDED, "int8": root / "int8", "broken": root / "broken"}


class Server:
    def __init__(self, models: dict[str, Path], *extra: str, ready_timeout: float = 300):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        specs = [f"{k}={v}" for k, v in models.items()]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onnxdiffusion.cli", "serve", *specs, "--port", str(self.port), *extra],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.client = httpx.Client(base_url=self.url, timeout=120)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if self.client.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError("server did not become ready")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def server(serve_models):
    srv = Server(serve_models, "--buckets", "64x64,128x128", "--workers", "1", "--max-queue", "6",
                 "--timeout", "90", "--max-batch", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    """Images from the library itself, keyed by settings: what `generate` gives (None: the model's recommended)."""
    from onnxdiffusion.runtime import Pipeline

    pipe = Pipeline.from_folder(EMBEDDED, threads=1)
    cache = {}

    def render(prompt, seed, steps, sampler="ddim", guidance=None, size=64, n=1):
        key = (prompt, seed, steps, sampler, guidance, size, n)
        if key not in cache:
            cache[key] = pipe(prompt, seed=seed, steps=steps, sampler=sampler, guidance=guidance,
                              width=size, height=size, batch=n).images
        return cache[key]

    return render


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def b64_image(item: dict) -> np.ndarray:
    return decode_png(base64.b64decode(item["b64_json"]))


def assert_clean_error(resp, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]["message"], body
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if param is not None:
        assert body["error"]["param"] == param, body
    return body


# -- probes, models, docs ---------------------------------------------------------------------
@pytest.mark.slow
def test_probes_models_and_docs(server):
    c = server.client
    assert c.get("/health").json() == {"status": "ok"}
    ready = c.get("/ready").json()
    assert ready["ready"] is True and ready["degraded"] == ["broken"]
    models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert set(models) == {"fp32", "int8", "broken"}
    assert models["int8"]["status"] == "ok" and models["int8"]["golden_psnr_db"] >= 30
    assert models["int8"]["sibling"] == "fp32" and models["int8"]["precision"] == "int8-dynamic"
    assert models["broken"]["status"] == "degraded" and models["broken"]["golden_psnr_db"] < 30
    assert models["broken"]["fallback_to"] == "fp32"
    # int8-dynamic quantizes activations with one scale over the whole batch: never micro-batched
    assert models["fp32"]["batch_invariant"] is True and models["int8"]["batch_invariant"] is False
    assert c.get("/v1/models/int8").json()["id"] == "int8"
    assert_clean_error(c.get("/v1/models/nope"), 404)
    paths = c.get("/openapi.json").json()["paths"]
    for p in ("/v1/images/generations", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/models",
              "/v1/models/{model_id}/check", "/health", "/ready", "/metrics"):
        assert p in paths, p
    assert c.get("/docs").status_code == 200
    page = c.get("/")
    assert page.status_code == 200 and "EventSource" in page.text


# -- OpenAI-compatible generation -------------------------------------------------------------
@pytest.mark.slow
def test_openai_client_call_matches_generate(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    resp = client.images.generate(model="fp32", prompt="a blue star above a yellow square", n=2, size="64x64",
                                  response_format="b64_json", extra_body={"steps": 4, "seed": 11, "guidance": 4.0})
    assert len(resp.data) == 2 and resp.data[0].revised_prompt == "a blue star above a yellow square"
    settings = resp.model_extra["settings"]
    assert settings["seed"] == 11 and settings["model"] == "fp32" and settings["bucket"] == "64x64"
    assert settings["fallback"] is False and settings["steps"] == 4
    want = reference("a blue star above a yellow square", 11, 4, guidance=4.0, n=2)
    for item, ref in zip(resp.data, want):
        np.testing.assert_array_equal(decode_png(base64.b64decode(item.b64_json)), ref)


@pytest.mark.slow
def test_size_snaps_to_bucket_and_url_format(server, reference):
    c = server.client
    r = c.post("/v1/images/generations", json={"prompt": "a large green triangle", "size": "100x70", "steps": 3,
                                               "seed": 2, "response_format": "url", "sampler": "euler_a"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["settings"]["bucket"] == "64x64" and body["settings"]["requested_size"] == "100x70"
    assert body["settings"]["sampler"] == "euler_a"
    png = httpx.get(body["data"][0]["url"], timeout=60)
    assert png.headers["content-type"] == "image/png"
    np.testing.assert_array_equal(decode_png(png.content), reference("a large green triangle", 2, 3, "euler_a")[0])
    r = c.post("/v1/images/generations", json={"prompt": "a red circle", "size": "120x140", "steps": 2, "seed": 1})
    assert r.json()["settings"]["bucket"] == "128x128"
    assert b64_image(r.json()["data"][0]).shape == (128, 128, 3)
    r = c.post("/v1/images/generations", json={"prompt": "a red circle", "steps": 2})
    assert isinstance(r.json()["settings"]["seed"], int)  # a random seed, echoed


# -- golden-sample fallback -------------------------------------------------------------------
@pytest.mark.slow
def test_broken_quantized_model_falls_back_to_fp32(server, reference):
    c = server.client
    r = c.post("/v1/images/generations", json={"prompt": "a small red circle on the left", "model": "broken",
                                               "steps": 4, "seed": 7})
    assert r.status_code == 200, r.text
    s = r.json()["settings"]
    assert s["model"] == "fp32" and s["model_requested"] == "broken" and s["fallback"] is True
    np.testing.assert_array_equal(b64_image(r.json()["data"][0]), reference("a small red circle on the left", 7, 4)[0])
    r = c.post("/v1/images/generations", json={"prompt": "a red circle", "model": "int8", "steps": 2, "seed": 7})
    assert r.json()["settings"]["model"] == "int8" and r.json()["settings"]["fallback"] is False
    again = c.post("/v1/models/broken/check").json()
    assert again["status"] == "degraded" and again["golden_psnr_db"] < 30
    assert c.post("/v1/models/int8/check").json()["status"] == "ok"
    assert_clean_error(c.post("/v1/models/nope/check"), 404)
    metrics = c.get("/metrics").text
    assert 'onnxdiffusion_fallbacks_total{model="broken"}' in metrics
    assert 'onnxdiffusion_model_degraded{model="broken"} 1.0' in metrics
    assert 'onnxdiffusion_model_degraded{model="int8"} 0.0' in metrics


# -- jobs: progress, events, cancel, queue --------------------------------------------------
def _sse(client, job_id: str) -> list[tuple[str, dict]]:
    events, name = [], None
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == "done":
                    break
    return events


@pytest.mark.slow
def test_job_events_progress_and_result(server, reference):
    c = server.client
    r = c.post("/v1/jobs", json={"prompt": "a purple square", "steps": 6, "seed": 4, "preview": True})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["steps"] == 6
    events = _sse(c, job["id"])
    assert events[-1][0] == "done" and events[-1][1]["status"] == "succeeded"
    steps = [e["step"] for _, e in events]
    assert steps == sorted(steps) and steps[-1] == 6
    assert any(e.get("preview") for _, e in events)
    status = c.get(f"/v1/jobs/{job['id']}").json()
    assert status["status"] == "succeeded" and status["progress"] == 1.0 and status["queue_position"] is None
    png = c.get(status["images"][0])
    np.testing.assert_array_equal(decode_png(png.content), reference("a purple square", 4, 6)[0])
    result = c.get(f"/v1/jobs/{job['id']}/result").json()
    assert result["settings"]["seed"] == 4 and len(result["data"]) == 1
    assert_clean_error(c.get(f"/v1/jobs/{job['id']}/images/5"), 404)
    assert_clean_error(c.delete(f"/v1/jobs/{job['id']}"), 409, "id")  # finished: nothing to cancel
    assert_clean_error(c.delete("/v1/jobs/0123456789abcdef"), 404, "id")
    assert_clean_error(c.get("/v1/jobs/0123456789abcdef"), 404, "id")


def _wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.slow
def test_cancel_one_job_queue_full_and_micro_batching(server, reference):
    c = server.client
    long = {"prompt": "a big blue circle", "size": "128x128", "n": 4, "steps": 100, "seed": 1}
    blocker = c.post("/v1/jobs", json=long).json()
    _wait(lambda: c.get(f"/v1/jobs/{blocker['id']}").json()["step"] >= 1)
    # four compatible requests queue behind it (one worker) and must run as one backbone batch
    seeds = [21, 22, 23, 24]
    small = [c.post("/v1/jobs", json={"prompt": f"a red star {s}", "steps": 3, "seed": s}).json() for s in seeds]
    assert [j["queue_position"] for j in small] == [0, 1, 2, 3]
    other = c.post("/v1/jobs", json={"prompt": "a green square", "steps": 5, "seed": 3}).json()
    victim = c.post("/v1/jobs", json={"prompt": "a green square", "steps": 5, "seed": 4}).json()
    full = c.post("/v1/jobs", json={"prompt": "one too many", "steps": 2})
    assert_clean_error(full, 503)
    assert int(full.headers["retry-after"]) >= 1
    # cancel the running blocker (between steps) and one queued job; nothing else is touched
    assert c.delete(f"/v1/jobs/{victim['id']}").json()["status"] == "cancelled"
    assert c.delete(f"/v1/jobs/{blocker['id']}").json()["cancel_requested"] is True
    done = _wait(lambda: (s := c.get(f"/v1/jobs/{blocker['id']}").json())["status"] == "cancelled" and s)
    assert done["step"] < 100
    for job, seed in zip(small, seeds):
        s = _wait(lambda: (x := c.get(f"/v1/jobs/{job['id']}").json())["status"] in ("succeeded", "failed") and x)
        assert s["status"] == "succeeded" and s["batch_size"] == 4
        np.testing.assert_array_equal(decode_png(c.get(s["images"][0]).content), reference(f"a red star {seed}", seed, 3)[0])
    s = _wait(lambda: (x := c.get(f"/v1/jobs/{other['id']}").json())["status"] == "succeeded" and x)
    assert c.get(f"/v1/jobs/{victim['id']}").json()["status"] == "cancelled"
    metrics = c.get("/metrics").text
    assert 'onnxdiffusion_jobs_total{model="fp32",outcome="cancelled"}' in metrics
    assert 'onnxdiffusion_requests_total{outcome="rejected",route="/v1/jobs"}' in metrics


@pytest.mark.slow
def test_batch_dependent_model_is_not_micro_batched(server, serve_models):
    from onnxdiffusion.runtime import Pipeline

    c = server.client
    blocker = c.post("/v1/jobs", json={"prompt": "a big circle", "size": "128x128", "n": 4, "steps": 100}).json()
    _wait(lambda: c.get(f"/v1/jobs/{blocker['id']}").json()["step"] >= 1)
    jobs = [c.post("/v1/jobs", json={"prompt": p, "steps": 3, "seed": 5, "model": "int8"}).json()
            for p in ("a red circle", "a blue star above a green square")]
    c.delete(f"/v1/jobs/{blocker['id']}")
    pipe = Pipeline.from_folder(serve_models["int8"], threads=1)
    for job, prompt in zip(jobs, ("a red circle", "a blue star above a green square")):
        s = _wait(lambda: (x := c.get(f"/v1/jobs/{job['id']}").json())["status"] == "succeeded" and x)
        assert s["batch_size"] == 1
        np.testing.assert_array_equal(decode_png(c.get(s["images"][0]).content), pipe(prompt, seed=5, steps=3).images[0])


# -- bad input --------------------------------------------------------------------------------
BAD = [
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": "x", "steps": 0}, "steps"), ({"prompt": "x", "steps": 1000}, "steps"),
    ({"prompt": "x", "size": "0x0"}, "size"), ({"prompt": "x", "size": "5000x5000"}, "size"),
    ({"prompt": "x", "size": "big"}, "size"), ({"prompt": "x", "model": "nope"}, "model"),
    ({"prompt": "x", "sampler": "magic"}, "sampler"), ({"prompt": "x", "sampler": "flow_euler"}, "sampler"), ({"prompt": "x", "guidance": -1}, "guidance"),
    ({"prompt": "x", "n": "two"}, "n"), ({"prompt": "x", "colour": "red"}, "colour"),
    ({"prompt": "   "}, "prompt"), ({"n": 1}, "prompt"), ({"prompt": "x", "response_format": "gif"}, "response_format"),
]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/images/generations", "/v1/jobs"])
def test_bad_input_is_a_clean_4xx(server, route):
    c = server.client
    for body, param in BAD:
        resp = c.post(route, json=body)
        assert_clean_error(resp, 400, param)
    assert "missing required field 'prompt'" in c.post(route, json={"n": 1}).json()["error"]["message"]
    bad_json = c.post(route, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert "invalid JSON" in assert_clean_error(bad_json, 400)["error"]["message"]
    assert_clean_error(c.post(route, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    huge = {"prompt": "x" * 200_000}
    assert_clean_error(c.post(route, json=huge), 413)
    chunked = c.post(route, content=iter([b'{"prompt": "', b"y" * 100_000, b'"}']),
                     headers={"content-type": "application/json"})  # no Content-Length: counted while read
    assert_clean_error(chunked, 413)
    assert c.get("/health").json() == {"status": "ok"}
    assert c.post(route, json={"prompt": "still up", "steps": 1}).status_code in (200, 202)


@pytest.mark.slow
def test_metrics_are_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    route = "/v1/images/generations"
    for model in ("fp32", "int8", "fp32"):
        assert server.client.post(route, json={"prompt": "x", "steps": 2, "model": model}).status_code == 200
    # each outcome counted here, not left to whichever tests ran before on this worker
    assert server.client.post(route, json={"n": 1}).status_code == 400
    assert server.client.post(route, json={"prompt": "x" * 200_000}).status_code == 413
    assert server.client.get("/v1/models/no-such-model").status_code == 404
    families = {f.name: f for f in text_string_to_metric_families(server.client.get("/metrics").text)}
    for name in ("onnxdiffusion_requests", "onnxdiffusion_request_latency_seconds", "onnxdiffusion_queue_depth",
                 "onnxdiffusion_fallbacks", "onnxdiffusion_step_seconds", "onnxdiffusion_jobs"):
        assert name in families, sorted(families)
    outcomes = {s.labels.get("outcome") for s in families["onnxdiffusion_requests"].samples}
    assert {"ok", "invalid", "too_large", "not_found"} <= outcomes
    step_models = {s.labels.get("model") for s in families["onnxdiffusion_step_seconds"].samples}
    assert {"fp32", "int8"} <= step_models
    lat = [s for s in families["onnxdiffusion_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in lat) >= 3


# -- the web page in headless Chromium ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason="/usr/bin/chromium or chromedriver not installed (bash bench/install_chromium.sh)")
def test_web_page_in_headless_chromium(server, tmp_path):
    pytest.importorskip("selenium.webdriver")
    from onnxdiffusion.web.browser import chrome
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = chrome()  # onnxdiffusion.web.browser's headless Chromium
    try:
        wait = WebDriverWait(driver, 90, poll_frequency=0.05)
        driver.get(server.url + "/")
        wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 3)
        Select(driver.find_element(By.ID, "model")).select_by_value("fp32")
        steps = driver.find_element(By.ID, "steps")
        steps.clear()
        steps.send_keys("12")
        driver.find_element(By.ID, "submit").click()
        card = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".job"))[0]
        wait.until(lambda d: card.get_attribute("data-status") == "succeeded")
        assert int(card.get_attribute("data-events")) >= 2  # progress events arrived before the end
        assert card.find_element(By.CLASS_NAME, "steps").text == "step 12/12"
        img = card.find_element(By.CSS_SELECTOR, "img.result")
        wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 64)
        driver.save_screenshot(str(tmp_path / "serve_page.png"))
        assert (tmp_path / "serve_page.png").stat().st_size > 1000
        # a second, long job: cancel it from its card once it has made progress
        Select(driver.find_element(By.ID, "size")).select_by_value("128x128")
        steps.clear()
        steps.send_keys("100")
        driver.find_element(By.ID, "submit").click()
        second = wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".job")) == 2
                            and d.find_elements(By.CSS_SELECTOR, ".job")[0])
        wait.until(lambda d: second.get_attribute("data-status") == "running"
                   and second.find_element(By.CLASS_NAME, "bar").get_attribute("value") not in ("0", None))
        second.find_element(By.CLASS_NAME, "cancel").click()
        wait.until(lambda d: second.get_attribute("data-status") == "cancelled")
        job_id = second.get_attribute("id")[4:]
        assert server.client.get(f"/v1/jobs/{job_id}").json()["step"] < 100
        assert card.get_attribute("data-status") == "succeeded"  # the first job is untouched
        driver.save_screenshot(str(tmp_path / "serve_page_cancelled.png"))
    finally:
        driver.quit()


# -- graceful shutdown ------------------------------------------------------------------------
@pytest.mark.slow
def test_graceful_shutdown_finishes_in_flight_request(serve_models):
    srv = Server({"fp32": serve_models["fp32"]}, "--buckets", "64x64,128x128", "--workers", "1", "--grace", "120")
    try:
        result = {}

        def call():
            result["resp"] = srv.client.post("/v1/images/generations",
                                             json={"prompt": "a red circle", "steps": 40, "n": 2})

        t = threading.Thread(target=call)
        t.start()
        _wait(lambda: srv.client.get("/metrics").text.count("onnxdiffusion_step_seconds_count") > 0)
        # uvicorn finishes open requests, runs the lifespan shutdown, then re-raises the signal it caught
        assert srv.stop() in (0, 143, -signal.SIGTERM)  # 143: the CLI's exit status for SIGTERM
        t.join(60)
        assert result["resp"].status_code == 200, result["resp"].text
        assert len(result["resp"].json()["data"]) == 2
    finally:
        srv.stop()


def test_serve_cli_errors():
    """Refused before anything is served; in-process (run_cli_here: no interpreter start per case; the process
    entry of `serve` is what the Server cases run)."""
    from cli_helpers import run_cli_here

    proc = run_cli_here("serve", "--profile", "x", timeout=60)
    assert proc.returncode != 0 and "profile" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli_here("serve", "--buckets", "65x64", "--port", _free_port(), timeout=120)
    assert proc.returncode == 2 and "multiple of 16" in proc.stderr, proc.stderr
    proc = run_cli_here("serve", "--buckets", "64by64", timeout=60)
    assert proc.returncode == 2 and "WIDTHxHEIGHT" in proc.stderr, proc.stderr
    proc = run_cli_here("serve", "/nonexistent-model-folder", timeout=60)
    assert proc.returncode == 2 and "not found" in proc.stderr, proc.stderr


def test_profile_reaches_every_served_model():
    """`serve --profile P`: each model loads under the resolved profile (here the CPU one), not the CPU default."""
    from onnxdiffusion.folder.paths import default_model_folder
    from onnxdiffusion.serve.manager import ModelManager

    manager = ModelManager(((64, 64),), profile="cpu-fp32")
    manager.load([str(default_model_folder())], log=lambda m: None)
    (entry,) = manager.models.values()
    assert entry.pipeline.profile is not None and entry.pipeline.profile.profile.name == "cpu-fp32"
    plain = ModelManager(((64, 64),))
    plain.load([str(default_model_folder())], log=lambda m: None)
    assert next(iter(plain.models.values())).pipeline.profile is None
