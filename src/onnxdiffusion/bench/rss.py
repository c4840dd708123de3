"""Resident-memory readings of this process (Linux /proc, with a getrusage fallback elsewhere)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def status_bytes(key: str) -> int | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM, RssAnon, ...) in bytes; None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss_bytes() -> int | None:
    return status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """VmHWM: the kernel's high-water mark of this process's resident set."""
    peak = status_bytes("VmHWM")
    if peak is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
        v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return v if sys.platform == "darwin" else v * 1024
    return peak


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
