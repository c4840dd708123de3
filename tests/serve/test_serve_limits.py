"""Size limits the families declare, per-model buckets, and models that fail (load, warm-up, mid-job).

In-process (FastAPI's TestClient runs the lifespan, so warm-up happens as in `serve`); both embedded
models: the SD UNet takes any multiple of 16, the MMDiT at most 64x64 (its position table).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from cli_helpers import run_cli_here  # noqa: E402  (the verbs in-process: no interpreter start per case)

from onnxdiffusion.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SD = ROOT / "models" / "shapes-sd-onnx"
MMDIT = ROOT / "models" / "shapes-mmdit-onnx"


def test_families_declare_their_limits():
    from onnxdiffusion.folder.artifacts import read_manifest
    from onnxdiffusion.runtime.guards import size_limits

    mmdit = size_limits(read_manifest(MMDIT))
    assert (mmdit.multiple, mmdit.max_height, mmdit.max_width) == (8, 64, 64)  # pos_embed_max_size 8 x patch 2 x VAE 4
    assert "pos_embed_max_size 8" in mmdit.why
    assert mmdit.problem(64, 64) is None and mmdit.problem(56, 64) is None
    assert "at most 64" in mmdit.problem(128, 64) and "multiple of 8" in mmdit.problem(60, 64)
    sd = size_limits(read_manifest(SD))
    assert sd.multiple == 16 and sd.max_height == 16384 and sd.problem(128, 96) is None


@pytest.mark.parametrize("args", [("--height", 128, "--width", 128), ("--height", 64, "--width", 72)])
def test_generate_refuses_sizes_beyond_the_model_in_one_line(tmp_path, args):
    proc = run_cli_here("generate", MMDIT, "a red circle", *args, "--steps", 1, "-o", tmp_path / "x.png")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr
    assert "at most 64" in lines[0] or "multiple of 8" in lines[0]
    assert not (tmp_path / "x.png").exists()


def test_batch_refuses_sizes_beyond_the_model(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red circle", "size": "128x128"}\n')
    proc = run_cli_here("batch", prompts, tmp_path / "out", "--model", MMDIT, "--quiet")
    assert proc.returncode == 2 and "at most 64" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.png"))


def test_manager_keeps_each_models_buckets():
    from onnxdiffusion.serve.manager import ModelManager, parse_buckets

    manager = ModelManager(parse_buckets("64x64,128x128,64x128"))
    logs = []
    manager.load([f"sd={SD}", f"mmdit={MMDIT}"], log=logs.append)
    assert manager.models["sd"].buckets == ((64, 64), (128, 128), (64, 128))
    assert manager.models["mmdit"].buckets == ((64, 64),)
    assert [d.split(":")[0] for d in manager.models["mmdit"].dropped] == ["128x128", "64x128"]
    assert any("mmdit" in m and "dropped 128x128, 64x128" in m for m in logs), logs
    assert manager.snap(manager.models["mmdit"], 128, 128) == (64, 64)
    with pytest.raises(UserError, match="no bucket fits model"):
        ModelManager(parse_buckets("128x128")).load([str(MMDIT)], log=lambda m: None)
    with pytest.raises(UserError, match="fit no served model"):  # 72x72: not a multiple of 16, above 64
        ModelManager(parse_buckets("64x64,72x72")).load([str(SD), str(MMDIT)], log=lambda m: None)


def _app(models, buckets="64x64,128x128", **kw):
    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig

    config = ServeConfig(models=tuple(models), buckets=buckets, **{"workers": 1, "max_batch": 2, **kw})
    return create_app(config)


def _wait_ready(client, timeout=240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get("/ready").json()
        if body["ready"] or body["error"]:
            return body
        time.sleep(0.1)
    raise AssertionError("not ready")


def test_both_models_serve_and_sizes_beyond_a_model_get_400():
    from fastapi.testclient import TestClient

    with TestClient(_app([f"sd={SD}", f"mmdit={MMDIT}"])) as client:
        ready = _wait_ready(client)
        assert ready["ready"] and ready["failed"] == {}, ready
        models = {m["id"]: m for m in ready["models"]}
        assert models["mmdit"]["buckets"] == ["64x64"] and models["mmdit"]["dropped_buckets"][0].startswith("128x128")
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "model": "mmdit", "size": "128x128"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
        assert "at most 64" in r.json()["error"]["message"]
        for model, size in (("mmdit", "64x64"), ("sd", "128x128")):
            r = client.post("/v1/images/generations", json={"prompt": "a red circle", "model": model, "size": size,
                                                            "steps": 2})
            assert r.status_code == 200, r.text
            assert r.json()["settings"]["bucket"] == size


class FailingSession:
    """A backbone session that raises on its `fail_at`-th call (a fault injected mid-job)."""

    def __init__(self, real, fail_at: int, forever: bool = False):
        self.real, self.fail_at, self.forever, self.calls = real, fail_at, forever, 0

    def _tick(self):
        self.calls += 1
        if self.calls == self.fail_at or (self.forever and self.calls > self.fail_at):
            raise RuntimeError("injected fault: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code")

    def run(self, *a, **k):
        self._tick()
        return self.real.run(*a, **k)

    def run_with_iobinding(self, *a, **k):
        self._tick()
        return self.real.run_with_iobinding(*a, **k)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_warmup_failure_is_named_in_ready_while_the_other_model_serves(monkeypatch):
    from fastapi.testclient import TestClient

    from onnxdiffusion.runtime import Pipeline

    real = Pipeline.from_folder

    def from_folder(folder, **kw):
        pipe = real(folder, **kw)
        if Path(folder) == MMDIT:
            pipe.backbone = FailingSession(pipe.backbone, 1, forever=True)
        return pipe

    monkeypatch.setattr(Pipeline, "from_folder", staticmethod(from_folder))
    with TestClient(_app([f"sd={SD}", f"mmdit={MMDIT}"], buckets="64x64")) as client:
        ready = _wait_ready(client)
        assert ready["ready"], ready
        assert "injected fault" in ready["failed"]["mmdit"] and "warm-up failed" in ready["failed"]["mmdit"]
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "model": "mmdit"})
        assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"], r.text
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "model": "sd", "steps": 2})
        assert r.status_code == 200, r.text


def test_only_model_failing_warmup_is_not_ready_with_its_reason(monkeypatch):
    from fastapi.testclient import TestClient

    from onnxdiffusion.runtime import Pipeline

    real = Pipeline.from_folder

    def from_folder(folder, **kw):
        pipe = real(folder, **kw)
        pipe.backbone = FailingSession(pipe.backbone, 1, forever=True)
        return pipe

    monkeypatch.setattr(Pipeline, "from_folder", staticmethod(from_folder))
    with TestClient(_app([str(MMDIT)], buckets="64x64")) as client:
        ready = _wait_ready(client)
        assert not ready["ready"] and "injected fault" in ready["error"], ready
        assert client.get("/ready").status_code == 503


def _job(client, body, timeout=120.0) -> dict:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = client.get(f"/v1/jobs/{r.json()['id']}").json()
        if snap["status"] in ("succeeded", "failed", "cancelled", "timeout"):
            return snap
        time.sleep(0.05)
    raise AssertionError("job did not finish")


@pytest.mark.parametrize("fail_at", [1, 3, 7])  # the backbone raises at its first, third, seventh call
def test_session_fault_mid_job_fails_that_job_and_the_model_is_reloaded(fail_at):
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    app = _app([f"sd={SD}", f"mmdit={MMDIT}"], buckets="64x64", workers=2)
    with TestClient(app) as client:
        assert _wait_ready(client)["ready"]
        entry = app.state.service.manager.models["sd"]
        first = entry.pipeline
        first.backbone = FailingSession(first.backbone, fail_at)
        with ThreadPoolExecutor(2) as pool:  # the other model's job runs beside the faulting one
            other = pool.submit(_job, client, {"prompt": "a blue star", "model": "mmdit", "steps": 12, "seed": 3})
            bad = pool.submit(_job, client, {"prompt": "a red circle", "model": "sd", "steps": 8, "seed": 1})
            bad, other = bad.result(), other.result()
        assert bad["status"] == "failed" and "the model failed while running (injected fault" in bad["error"], bad
        assert other["status"] == "succeeded", other
        ready = client.get("/ready").json()
        sd = next(m for m in ready["models"] if m["id"] == "sd")
        assert ready["ready"] and sd["status"] == "ok" and sd["faults"] == 1 and sd["reloads"] == 1, sd
        assert entry.pipeline is not first  # a fresh session serves now
        again = _job(client, {"prompt": "a red circle", "model": "sd", "steps": 8, "seed": 1})
        assert again["status"] == "succeeded", again


def test_session_fault_whose_reload_fails_marks_the_model_failed(monkeypatch):
    from fastapi.testclient import TestClient

    from onnxdiffusion.runtime import Pipeline

    app = _app([f"sd={SD}", f"mmdit={MMDIT}"], buckets="64x64", workers=1)
    with TestClient(app) as client:
        assert _wait_ready(client)["ready"]
        pipe = app.state.service.manager.models["sd"].pipeline
        pipe.backbone = FailingSession(pipe.backbone, 2)

        def broken(folder, **kw):
            raise UserError(f"{folder}: file unet/model.onnx does not match its sha256 in manifest.json")

        monkeypatch.setattr(Pipeline, "from_folder", staticmethod(broken))
        bad = _job(client, {"prompt": "a red circle", "model": "sd", "steps": 4})
        assert bad["status"] == "failed", bad
        ready = client.get("/ready").json()
        assert ready["ready"] and "reload failed" in ready["failed"]["sd"] and "sha256" in ready["failed"]["sd"], ready
        r = client.post("/v1/images/generations", json={"prompt": "x", "model": "sd"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert _job(client, {"prompt": "a blue star", "model": "mmdit", "steps": 2})["status"] == "succeeded"
