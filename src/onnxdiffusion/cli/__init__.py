"""Command line: a map from verb to typed library function (the verbs: pipeline.py and the other modules
here; docstrings are the help), and the process around a verb: exit statuses, one-line errors, signals."""

from __future__ import annotations

import os
import signal
import sys


def _exit_early(signum, frame):
    """A signal while Python still imports the CLI: nothing exists yet to clean up; one line, the usual status."""
    os.write(2, b"error: interrupted\n" if signum == signal.SIGINT else b"error: terminated\n")
    os._exit(130 if signum == signal.SIGINT else 143)


def _started_as_cli() -> bool:
    argv0 = os.path.basename(sys.argv[0] if sys.argv else "")
    # `python -m onnxdiffusion.cli` imports this package while argv[0] is still "-m" (then .../cli/__main__.py)
    by_module = argv0 == "-m" and __name__ in getattr(sys, "orig_argv", ())
    return by_module or argv0 in ("onnxdiffusion", "cli.py", "__main__.py")


if _started_as_cli():  # the imports below take a second or more; run() takes over the signals after them
    try:
        for _sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(_sig, _exit_early)
    except ValueError:  # not the main thread
        pass

import functools  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import typer.main  # noqa: E402

from .. import interrupts  # noqa: E402
from ..folder import tempfiles  # noqa: E402
from .app import app  # noqa: E402 - the entry point's Typer (verbs register on it)
from ..errors import UserError  # noqa: E402
from ..interrupts import Terminated  # noqa: E402,F401 - SIGTERM's exception, named here since before interrupts.py


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


# the verbs register on `app` when imported, in the order `--help` lists them: the pipeline's verbs first
from . import pipeline  # noqa: E402,F401 - export, generate, compile-loop, quantize
from . import measure, deploy, lora  # noqa: E402,F401
from . import web  # noqa: E402,F401 - export-web
from . import controlnet  # noqa: E402,F401 - add-controlnet
from . import cache  # noqa: E402,F401 - cache calibrate
from . import tune  # noqa: E402,F401 - tune


_received = interrupts.received  # the signals the current verb got (run() starts it empty; main() reads it)


def _on_signal(signum, frame):
    """The first SIGINT/SIGTERM of a verb raises (KeyboardInterrupt / Terminated) and starts the unwind; a repeat
    during that unwind is only noted: raised again it would land in a `finally` or in run()'s own handler and cut
    short the cleanup the first one started (a staging folder half removed, a second error line, a traceback).
    Noted either way in `interrupts`, so a first one that library code catches still stops the verb at its next
    publishing step. A repeat that finds no exception being handled while the verb still runs means the first
    was caught and dropped: it raises (the first signal's exception), so a second Ctrl-C is not a dead key."""
    interrupts.note(signum)
    if len(_received) > 1 and not (interrupts.watching() and sys.exc_info()[1] is None):
        return
    raise interrupts.exception(_received[0])


def _usage_error(e: BaseException) -> bool:
    # typer >= 0.20 vendors click as typer._click: recognise its exceptions by their interface
    return callable(getattr(e, "format_message", None)) and isinstance(getattr(e, "exit_code", None), int)


def _internal_error(e: BaseException, debug: bool) -> str:
    """The one line, naming where the traceback is; --debug prints the traceback instead."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if debug:
        sys.stderr.write(text)
        return f"error: internal error: {type(e).__name__}: {first}"
    fd, path = tempfile.mkstemp(prefix="onnxdiffusion-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return f"error: internal error: {type(e).__name__}: {first} (traceback in {path}; rerun with --debug to print it)"


@functools.cache
def _command():
    """The click command typer derives from the verbs' signatures, built once per process: typer rebuilds it on
    every `app(...)` call (0.1 s, more than a refusal's own work), and run() is called many times in-process."""
    return typer.main.get_command(app)


def run(argv: list[str] | None = None) -> int:
    """The CLI as a function returning its exit status (tests call this in-process).

    2: bad input or an unusable artifact (one line); 130: interrupted (Ctrl-C); 143: terminated (SIGTERM);
    1: an internal error (one line plus where its traceback was written).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if not args:
        args = ["--help"]
    old_show = warnings.showwarning
    warnings.showwarning = _one_line_warning
    old_term = None
    interrupts.begin()
    if signal.getsignal(signal.SIGINT) is _exit_early:  # from here on Ctrl-C is a KeyboardInterrupt that cleans up
        signal.signal(signal.SIGINT, _on_signal)
    try:
        old_term = signal.signal(signal.SIGTERM, _on_signal)
    except ValueError:  # not the main thread: leave SIGTERM alone
        pass
    try:
        rv, line = _outcome(args, debug)
        signalled = interrupts.status()
        if signalled is not None and rv not in (130, 143):
            # a signal came during the verb but something caught its exception: the verb's own result (a success,
            # an error it caused) is not what ended it
            rv, line = signalled, interrupts.LINE[signalled]
        if line:
            _say(line, file=sys.stderr)
        return rv
    finally:
        interrupts.end()
        warnings.showwarning = old_show
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _outcome(args: list[str], debug: bool) -> tuple[int, str | None]:
    """Run the verb: its exit status and the one line to print for it (None: nothing)."""
    try:
        with tempfiles.session():  # every temporary file of the verb under one root, removed however it ends
            rv = _command().main(args=args, prog_name="onnxdiffusion", standalone_mode=False)
        if rv == 130:  # typer turns Ctrl-C into a silent 130
            return 130, interrupts.LINE[130]
        return (rv if isinstance(rv, int) and rv in (0, 1, 2, 130, 143) else 0), None
    except UserError as e:
        return 2, f"error: {_one_line(str(e))}"
    except KeyboardInterrupt:
        return 130, interrupts.LINE[130]
    except Terminated:
        return 143, interrupts.LINE[143]
    except MemoryError:
        return 2, "error: out of memory (use a smaller size or batch)"
    except OSError as e:  # the file system said no: a full disk, a permission, a vanished folder
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        return 2, f"error: {_one_line(e.strerror or str(e))}{where}"
    except Exception as e:
        # e.g. an ImportError raised because Ctrl-C hit a module's initialisation, or a library's own error for
        # the interrupt it caught: the signal's status, and no traceback file
        cause = _signal_cause(e) or interrupts.status()
        if cause is not None:
            return cause, interrupts.LINE[cause]
        if _usage_error(e):
            return e.exit_code, f"error: {_one_line(e.format_message())} (see --help)"
        if isinstance(getattr(e, "exit_code", None), int):  # click's Exit
            return e.exit_code, None
        return 1, _internal_error(e, debug)
    finally:
        interrupts.end()  # the verb is over: nothing more to publish, and a repeated signal stays a note


def _signal_cause(e: BaseException) -> int | None:
    """130 / 143 if a Ctrl-C or SIGTERM is what this exception is about (click's Abort, or one chained)."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, Terminated):
            return 143
        if isinstance(e, KeyboardInterrupt) or type(e).__name__ == "Abort":
            return 130
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _say(*args, **kwargs) -> None:
    """The final error line, on a line of its own: progress bars still open are closed first."""
    tqdm_module = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm_module, "tqdm", None), "_instances", ())):
        bar.close()
    print(*args, **kwargs)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main() -> None:
    try:
        rv = run()
    except (KeyboardInterrupt, Terminated) as e:  # a first signal that landed as run() returned, past its handlers
        rv = 143 if isinstance(e, Terminated) else 130
        _say(interrupts.LINE[rv], file=sys.stderr)
    # the verb is over (its output renamed into place, its temporary root gone): a signal arriving now must not
    # turn the status into a death by that signal during the interpreter's shutdown
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(s, signal.SIG_IGN)
        except ValueError:  # not the main thread
            break
    if rv == 0 and interrupts.status() is not None:  # a signal run() did not see end as one: never as a success
        rv = interrupts.status()
        _say(interrupts.LINE[rv], file=sys.stderr)
    if _received or rv in (130, 143):
        _exit_now(rv)
    sys.exit(rv)


def _exit_now(rv: int) -> None:
    """End a process whose verb a signal stopped without the interpreter's shutdown, which can change the status:
    CPython remembers a KeyboardInterrupt that left any exec() or eval() of a string (a dataclass or namedtuple
    being made while a module imports, say) even when the caller caught it, and under `python -m` then ends the
    process by re-raising SIGINT at exit: status -2, not 130, after the one error line (issue 41). The shutdown
    would also finalize what the signal left half-built (torch's tracer, an ONNX Runtime session) while the
    libraries' native worker threads still run. The verb's own cleanup is done (the temporary root, the tracked
    staging paths); what remains is flushing the standard streams."""
    tempfiles.cleanup_all()  # normally a no-op: the session removed everything; the atexit hook will not run
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced (a broken pipe, a test harness)
            pass
    os._exit(rv)

