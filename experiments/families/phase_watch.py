#!/usr/bin/env python
"""Peak RSS per phase of a running export, from outside the process (qwen20b.md's method): the log's tqdm postfix
names the component being exported; at each change the process's VmHWM (with RssAnon / RssFile) is recorded and
reset through /proc/PID/clear_refs (5), so each row's peak is its phase's. RssAnon / RssFile are also sampled every
`--every` seconds and their maxima per phase kept (VmHWM alone does not say how much of the peak is file-backed).

    python experiments/families/phase_watch.py PID LOG OUT.json [--every 10]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status(pid: int) -> dict | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {k: int(m.group(1)) * 1024 for k in FIELDS if (m := re.search(rf"^{k}:\s+(\d+) kB", text, re.M))}


def phase(log: Path) -> str | None:
    # tqdm rewrites its line with \r: the last postfix in the log names the component now exported
    names = re.findall(r"export:[^\r\n]*?, ([A-Za-z_0-9]+)\]", log.read_text(errors="replace"))
    return names[-1] if names else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("log", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--every", type=float, default=10.0)
    a = ap.parse_args()
    rows, label, t0 = [], "start", time.time()
    anon = file = 0
    last = status(a.pid)
    while True:
        s = status(a.pid)
        now_label = phase(a.log) or label
        if s is None or now_label != label:
            end = s or last
            rows.append({"phase": label, "seconds": round(time.time() - t0, 1), "peak_rss_bytes": end.get("VmHWM"),
                         "max_rss_anon_sampled": anon, "max_rss_file_sampled": file,
                         "rss_anon_end": end.get("RssAnon"), "rss_file_end": end.get("RssFile")})
            a.out.write_text(json.dumps(rows, indent=1) + "\n")
            if s is None:
                return
            Path(f"/proc/{a.pid}/clear_refs").write_text("5")
            label, t0, anon, file = now_label, time.time(), 0, 0
        anon, file, last = max(anon, s.get("RssAnon", 0)), max(file, s.get("RssFile", 0)), s
        time.sleep(a.every)


if __name__ == "__main__":
    main()
