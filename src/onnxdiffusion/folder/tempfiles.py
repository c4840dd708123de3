"""Every temporary file under one cleanup, safe against Ctrl-C and SIGTERM at any point.

`session()` (the CLI runs each verb in one) makes one root folder, `TMPDIR/onnxdiffusion-run-PID-*`,
and points `tempfile` (and the TMPDIR of child processes) at it, so every temporary file and folder
made during the verb, ours and the libraries' (ONNX Runtime's quantizer, torch's exporter), lies
under it; at the end, however the verb ends, the root goes in one removal. Roots left by a process
that was SIGKILLed are swept by the next session (their PID no longer runs).

Paths outside the root that must not outlive a failure (the staging folder beside an output,
`artifacts.atomic_dir`) are `track`ed and removed with the root. Creating and removing a tracked path
runs with the signal handlers deferred (`deferred_signals`): a Ctrl-C that lands inside `mkdtemp` or
half-way through `rmtree` is held until the registry is consistent, then raised as usual; this
closes the window where `tempfile.TemporaryDirectory` had detached its finalizer but not finished
removing (the `onnxdiffusion-dyn-*` leak of issue 27).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT_PREFIX = "onnxdiffusion-run-"
_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)
_lock = threading.RLock()
_tracked: list[str] = []
_outer: list[tuple[str | None, str]] = []  # (tempfile.tempdir, its resolved folder) before each active session


@contextlib.contextmanager
def deferred_signals(reraise: bool = True) -> Iterator[None]:
    """SIGINT/SIGTERM arriving inside the block are held and delivered (to the previous handler) when it
    ends; reraise=False drops them (the process is on its way out anyway). Outside the main thread signals
    never interrupt this thread's Python code, so there is nothing to defer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    for s in _SIGNALS:
        previous[s] = signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if held and reraise:
            handler = previous[held[0]]
            if callable(handler):
                handler(held[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(held[0])


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            os.unlink(path)


def track(path: str | Path) -> None:
    with _lock:
        _tracked.append(str(path))


def untrack(path: str | Path) -> None:
    with _lock, contextlib.suppress(ValueError):
        _tracked.remove(str(path))


def remove(path: str | Path) -> None:
    """Remove a tracked path (signals deferred until it is gone) and forget it."""
    with deferred_signals():
        _remove(str(path))
        untrack(path)


def mkdtemp(prefix: str, suffix: str = "", dir: str | Path | None = None) -> Path:
    """tempfile.mkdtemp, tracked from the instant it exists."""
    with deferred_signals():
        path = tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=dir)
        track(path)
    return Path(path)


@contextlib.contextmanager
def directory(prefix: str = "onnxdiffusion-", dir: str | Path | None = None) -> Iterator[Path]:
    """A temporary folder removed at the end of the block, or with the session if the block's own removal
    never ran."""
    path = mkdtemp(prefix, dir=dir)
    try:
        yield path
    finally:
        remove(path)


def cleanup_all(reraise: bool = False) -> None:
    """Remove every tracked path (newest first)."""
    with deferred_signals(reraise):
        with _lock:
            paths = list(reversed(_tracked))
            _tracked.clear()
        for p in paths:
            _remove(p)


def _sweep(base: str) -> None:
    """Remove roots of sessions whose process is gone (a SIGKILL leaves its root behind)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith(ROOT_PREFIX):
            continue
        pid = name[len(ROOT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path = os.path.join(base, name)
            with contextlib.suppress(OSError):
                if os.stat(path).st_uid == os.getuid():
                    shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


@contextlib.contextmanager
def session() -> Iterator[Path]:
    """One root for every temporary file of the block (see the module docstring)."""
    base = tempfile.gettempdir()
    _sweep(base)
    root = mkdtemp(f"{ROOT_PREFIX}{os.getpid()}-", dir=base)
    old_env = os.environ.get("TMPDIR")
    _outer.append((tempfile.tempdir, base))
    tempfile.tempdir, os.environ["TMPDIR"] = str(root), str(root)
    try:
        yield root
    finally:
        tempfile.tempdir = _outer.pop()[0]
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        cleanup_all()


atexit.register(cleanup_all)
