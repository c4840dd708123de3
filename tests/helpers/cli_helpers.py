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


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class CaseTimeout(BaseException):
    """Raised by the alarm: not an Exception, so the CLI's handlers cannot swallow it."""


def invoke(*args, timeout: float = 60) -> Result:
    """The CLI in-process (onnxdiffusion.cli.run), stdout/stderr captured, under a wall-clock timeout."""
    import contextlib
    import io
    import signal

    from onnxdiffusion.cli import run

    def alarm(signum, frame):
        raise CaseTimeout(f"timed out after {timeout}s: {args}")

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run([str(a) for a in args])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Result(code, out.getvalue(), err.getvalue())


def run_cli_here(*args, timeout: float = 600) -> Result:
    """run_cli's checks (exit status, stdout, stderr) without a process: `python -m onnxdiffusion.cli` is this
    same cli.run plus sys.exit, and a process per case costs an interpreter start and its imports (torch for
    export and quantize), more than most cases' work. The process entry itself is run by test_signals,
    test_faults, test_serve and the run_cli cases."""
    return invoke(*args, timeout=timeout)
