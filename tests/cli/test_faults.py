"""Faults (issue 27, acceptance 2): a full disk, SIGKILL, a memory budget.

ENOSPC is real: the output folder and TMPDIR lie on a small tmpfs filled to leave a chosen number
of bytes free, so the disk fills at several points of each verb's writing (skipped where no tmpfs
can be mounted: it needs root). Each case must end with one `error:` line naming the full disk,
exit 2, no output (or, for the resumable `batch`, only whole PNGs), nothing left in TMPDIR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnxdiffusion.folder.paths import default_model_folder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "onnxdiffusion.cli"]
MMDIT = ROOT / "models" / "shapes-mmdit-onnx"


class SmallFs:
    def __init__(self, mount: Path):
        self.mount = mount
        self.tmp = mount / "tmp"
        self.tmp.mkdir()

    def free(self) -> int:
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    def leave(self, free: int) -> None:
        """Fill the file system so that about `free` bytes stay free (tmpfs counts whole 4 KiB pages)."""
        need = self.free() - free
        if need > 0:
            with open(self.mount / "filler", "ab") as f:
                os.posix_fallocate(f.fileno(), 0, need + (os.path.getsize(self.mount / "filler")
                                                          if (self.mount / "filler").exists() else 0))

    def env(self) -> dict:
        return {**os.environ, "TMPDIR": str(self.tmp), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir())


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mount)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the ENOSPC cases run where one can")
    try:
        yield SmallFs(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _run(args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


def _assert_full_disk(proc) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], proc.stderr[-2000:]


def _no_staging(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


FILL = (0.0, 0.35, 0.8)  # free space as a fraction of what the verb writes: the disk fills early, midway, late


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What a verb writes when there is room, run once (in-process) and shared by its three fill fractions:
    the bytes written do not depend on the fraction. `reference(name, argv)` runs argv(folder), an empty folder
    that everything the verb writes lands in, and returns the folder."""
    from cli_helpers import invoke

    made: dict[str, Path] = {}

    def get(name: str, argv) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"ref-{name}")
            res = invoke(*argv(out), timeout=600)
            assert res.returncode == 0, res.stderr[-2000:]
            made[name] = out
        return made[name]

    return get


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("fraction", FILL)
def test_enospc_generate(small_fs, fraction, reference):
    out = small_fs.mount / "out"
    out.mkdir()
    args = ["generate", default_model_folder(), "a red circle", "--steps", "2", "--batch", "4", "-o", out / "img.png"]
    need = _size(reference("generate", lambda d: [*args[:-1], d / "img.png"]))
    small_fs.leave(int(need * fraction))
    proc = _run(args, small_fs.env())
    _assert_full_disk(proc)
    assert list(out.iterdir()) == []  # all or nothing: no image, no staging file
    assert small_fs.leftovers() == []


@pytest.mark.parametrize("fraction", FILL)
def test_enospc_batch_keeps_only_whole_images_and_resumes(small_fs, fraction, tmp_path, reference):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "a red circle number {i}", "seed": {i}, "steps": 2}}\n' for i in range(8)))
    ref = reference("batch", lambda d: ["batch", prompts, d / "out", "--quiet", "--batch-size", "2"]) / "out"
    need = _size(ref)
    out = small_fs.mount / "out"
    small_fs.leave(int(need * fraction))
    proc = _run(["batch", prompts, out, "--quiet", "--batch-size", "2"], small_fs.env())
    _assert_full_disk(proc)
    assert small_fs.leftovers() == []
    if out.exists():
        assert _no_staging(out) == []
        for png in out.glob("*.png"):  # every image there is whole: byte-equal to the reference run's
            assert png.read_bytes() == (ref / png.name).read_bytes()
    (small_fs.mount / "filler").unlink()  # room again: the rerun finishes the rest
    again = _run(["batch", prompts, out, "--quiet", "--batch-size", "2"], small_fs.env())
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.glob("*.png")) == sorted(p.name for p in ref.glob("*.png"))


@pytest.mark.parametrize("fraction", FILL)
def test_enospc_export(small_fs, fraction, tiny_diffusers, reference):
    need = _size(reference("export", lambda d: ["export", tiny_diffusers, d / "out", "--no-validate"]))
    small_fs.leave(int(need * fraction))
    out = small_fs.mount / "out"
    proc = _run(["export", tiny_diffusers, out, "--no-validate"], small_fs.env())
    _assert_full_disk(proc)
    assert not out.exists() and _no_staging(small_fs.mount) == []
    assert small_fs.leftovers() == []


@pytest.mark.parametrize("fraction", FILL)
def test_enospc_quantize(small_fs, fraction, tiny_onnx, reference):
    args = ["--recipe", "int8-dynamic", "--calib-count", "4", "--calib-steps", "2", "--latency-runs", "1"]
    need = _size(reference("quantize", lambda d: ["quantize", tiny_onnx, d / "out", *args]))
    small_fs.leave(int(need * fraction))
    out = small_fs.mount / "out"
    proc = _run(["quantize", tiny_onnx, out, *args], small_fs.env())
    _assert_full_disk(proc)
    assert not out.exists() and _no_staging(small_fs.mount) == []
    assert small_fs.leftovers() == []


# -- SIGKILL ------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, tmpdir: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmpdir), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*CLI, "serve", f"sd={default_model_folder()}", f"mmdit={MMDIT}", "--port", str(port),
                             "--buckets", "64x64", "--workers", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _ready(client, proc, timeout=240.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            if client.get("/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("not ready")


def test_sigkill_mid_job_leaves_nothing_corrupt_and_a_restart_serves(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from onnxdiffusion.folder.artifacts import read_manifest, verify_folder

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = _free_port()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    proc = _start(port, tmpdir)
    try:
        _ready(client, proc)
        jobs = [client.post("/v1/jobs", json={"prompt": "a red circle", "steps": 100, "model": m}).json()["id"]
                for m in ("sd", "mmdit", "sd")]
        deadline = time.monotonic() + 120
        while client.get(f"/v1/jobs/{jobs[0]}").json()["step"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    for folder in (default_model_folder(), MMDIT):  # the model folders are read-only to the server: intact
        verify_folder(folder, read_manifest(folder))
    proc = _start(port, tmpdir)
    try:
        _ready(client, proc)
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "steps": 2, "model": "mmdit"})
        assert r.status_code == 200, r.text
        assert client.get(f"/v1/jobs/{jobs[0]}").status_code == 404  # a new process: the old jobs are gone, cleanly
        # the killed server's temporary root was swept by the new one; only the live one's remains
        assert [p.name.split("-")[2] for p in tmpdir.iterdir() if p.name.startswith("onnxdiffusion-run-")] == [str(proc.pid)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert [p for p in tmpdir.iterdir() if p.name.startswith("onnxdiffusion-run-")] == []


def test_sigkill_of_batch_leaves_whole_images_and_the_rerun_finishes(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "a blue star {i}", "seed": {i}, "steps": 30}}\n' for i in range(12)))
    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*CLI, "batch", str(prompts), str(out), "--quiet", "--batch-size", "2"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out.exists() and len(list(out.glob("*.png"))) >= 2):
        assert proc.poll() is None, "finished before the kill"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    from PIL import Image

    done = sorted(out.glob("*.png"))
    assert 2 <= len(done) < 12 and _no_staging(out) == []
    for png in done:
        with Image.open(png) as im:
            im.load()  # a whole PNG (a truncated one fails to decode)
    again = subprocess.run([*CLI, "batch", str(prompts), str(out), "--quiet", "--batch-size", "2"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"{len(done)} already done" in again.stdout and len(list(out.glob("*.png"))) == 12


# -- memory budget -----------------------------------------------------------------------------
def test_max_memory_refuses_requests_over_the_estimate_and_caps_micro_batches():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from onnxdiffusion.serve.app import create_app
    from onnxdiffusion.serve.config import ServeConfig, parse_bytes

    assert parse_bytes("30M") == 30 << 20 and parse_bytes("1.5GiB") == 3 << 29 and parse_bytes(None) is None
    config = ServeConfig(models=(str(default_model_folder()),), buckets="64x64,128x128", workers=1, max_batch=4,
                         max_memory=parse_bytes("30M"))
    app = create_app(config)
    with TestClient(app) as client:
        deadline = time.monotonic() + 240
        while not client.get("/ready").json()["ready"] and time.monotonic() < deadline:
            time.sleep(0.1)
        # the estimate: 20 MiB for one 128x128 image, 80 MiB for four
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 4, "size": "128x128"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "over_memory_budget", r.text
        assert "--max-memory" in r.json()["error"]["message"]
        r = client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 4, "size": "64x64", "steps": 2})
        assert r.status_code == 200, r.text  # 17 MiB: fits
        # two 128x128 jobs that could share a batch: together 40 MiB > 30, so each runs alone
        blocker = client.post("/v1/jobs", json={"prompt": "x", "steps": 40, "size": "64x64"}).json()
        a = client.post("/v1/jobs", json={"prompt": "a", "steps": 3, "size": "128x128", "seed": 1}).json()
        b = client.post("/v1/jobs", json={"prompt": "b", "steps": 3, "size": "128x128", "seed": 2}).json()
        for job in (blocker, a, b):
            while client.get(f"/v1/jobs/{job['id']}").json()["status"] not in ("succeeded", "failed"):
                time.sleep(0.05)
        sizes = [client.get(f"/v1/jobs/{j['id']}").json()["batch_size"] for j in (a, b)]
        assert sizes == [1, 1], sizes
