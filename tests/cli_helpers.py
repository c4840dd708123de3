"""Running the CLI as a user would, and the bad-input contract every verb keeps."""

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "onnxdiffusion.cli"]


def run_cli(*args, cwd=None, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def assert_one_line_error(proc, *fragments):
    """Non-zero exit, exactly one `error:` line holding every fragment, no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for f in fragments:
        assert f in errors[0], errors[0]
