"""Resident-memory readings of this process (Linux /proc, with a getrusage fallback elsewhere)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss_bytes() -> int | None:
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else None


def peak_rss_bytes() -> int:
    """VmHWM: the kernel's high-water mark of this process's resident set."""
    kb = _status_kb("VmHWM")
    if kb is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
        v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return v if sys.platform == "darwin" else v * 1024
    return kb * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
