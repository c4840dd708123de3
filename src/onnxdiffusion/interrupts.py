"""A SIGINT/SIGTERM the CLI received during a verb, kept where no library can swallow it.

The CLI's handler raises KeyboardInterrupt (or Terminated) to unwind the verb, but code the verb calls may catch
it (a bare `except:` or `except BaseException` in a loader, an exporter, a progress bar) and carry on: the verb
would finish, publish its output and exit 0 after a Ctrl-C (issue 41's swallowed interrupt). So the handler also
notes the signal here, every place that publishes a result (`artifacts.atomic_dir`, `artifacts.atomic_write_bytes`,
`imageio.save_images`, the web page's folder) calls `check()` right before its rename, and the CLI turns a noted
signal into its status whatever the verb returned. Only the CLI's handler notes signals and `check()` looks only
while a CLI verb runs (`begin` .. `end`), so library use never sees one.
"""

from __future__ import annotations

import signal

STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
LINE = {130: "error: interrupted", 143: "error: terminated"}


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so every `finally` and temporary-folder cleanup runs."""


received: list[int] = []  # the signals the current CLI verb got (begin() empties it; cli.main reads it after)
_watching = [False]  # a CLI verb is running: check() raises for a noted signal


def begin() -> None:
    received.clear()
    _watching[0] = True


def end() -> None:
    """The verb is over: publishing checks stop (what was noted stays for the exit status)."""
    _watching[0] = False


def watching() -> bool:
    return _watching[0]


def note(signum: int) -> None:
    received.append(signum)


def status() -> int | None:
    """130 / 143 for the first signal noted since begin(), None when none was."""
    return STATUS.get(received[0], 130) if received else None


def exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def check() -> None:
    """Raise the interruption again if the CLI got a signal during this verb, even one that code in between
    caught and dropped: called right before a result is renamed into place, so nothing is published after it."""
    if _watching[0] and received:
        raise exception(received[0])
