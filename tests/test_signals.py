"""Ctrl-C and SIGTERM in a real subprocess: exit 130 / 143, one line, no partial output, no temporary folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnxdiffusion.paths import default_model_folder

CLI = [sys.executable, "-m", "onnxdiffusion.cli"]


def _wait_ready(proc, ready, timeout: float = 240) -> None:
    t0 = time.time()
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"finished before it could be interrupted (exit {proc.returncode})")
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail("never became ready")
        time.sleep(0.05)


def _stderr_has(path: Path, text: str):
    return lambda: path.exists() and text in path.read_text(errors="replace")


def _scenario(verb: str, tmp: Path, tiny_onnx: Path, tiny_diffusers: Path):
    """argv, a readiness predicate (the verb is mid-work), and what must not exist afterwards."""
    err = tmp / "stderr.txt"
    work = tmp / "work"
    work.mkdir()
    if verb == "generate":
        argv = ["generate", default_model_folder(), "a red circle", "--steps", "500", "--batch", "8",
                "-o", work / "img.png"]
        return argv, _stderr_has(err, "sampling"), work
    if verb == "export":
        return ["export", tiny_diffusers, work / "out", "--no-validate"], _stderr_has(err, "export"), work
    if verb == "quantize":
        argv = ["quantize", tiny_onnx, work / "q", "--recipe", "int8-static", "--calib-count", "64"]
        return argv, _stderr_has(err, "capturing"), work
    if verb == "compile-loop":
        # 200 unrolled steps: ~2 s of work after "compiling" (the Loop form alone now compiles in ~0.3 s, so a
        # signal 0.3 s in could land after the folder's rename)
        argv = ["compile-loop", default_model_folder(), work / "l", "--whole", "--form", "unrolled", "--steps", "200"]
        return argv, _stderr_has(err, "compiling"), work
    if verb == "bench":
        argv = ["bench", default_model_folder(), "--variants", "ort-fp32", "--rss", "off", "--repeats", "50",
                "--prompts", "0", "--out", work / "b"]
        return argv, lambda: (work / "b").exists(), work
    raise AssertionError(verb)


@pytest.mark.parametrize("verb", ["generate", "export", "quantize", "compile-loop", "bench"])
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["SIGINT", "SIGTERM"])
def test_interrupt_leaves_nothing(verb, sig, code, word, tmp_path, tiny_onnx, tiny_diffusers):
    argv, ready, work = _scenario(verb, tmp_path, tiny_onnx, tiny_diffusers)
    scratch_tmp = tmp_path / "tmpdir"
    scratch_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch_tmp), "HF_HUB_OFFLINE": "1"}
    env.pop("TQDM_DISABLE", None)  # the progress bar is the readiness signal
    with open(tmp_path / "stderr.txt", "w") as err:
        # SIGINT back to its default in the child: a runner started in the background by a non-interactive
        # shell passes SIGINT on as ignored, and Python then installs no KeyboardInterrupt handler
        proc = subprocess.Popen([*CLI, *map(str, argv)], stdout=subprocess.DEVNULL, stderr=err, env=env,
                                cwd=work, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        _wait_ready(proc, ready)
        time.sleep(0.3)
        assert proc.poll() is None, "finished before the signal"
        proc.send_signal(sig)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("did not stop after the signal")
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {word}"], stderr[-2000:]
    assert list(work.iterdir()) == [], list(work.iterdir())  # no partial output, no hidden temp folder
    # no temporary folder and none of our temporary files (importing onnxruntime here drops a `.ses` file)
    assert [p for p in scratch_tmp.iterdir() if p.is_dir() or p.name.startswith(("onnxdiffusion", "tmp"))] == []
