#!/usr/bin/env python
"""Where a running process's anonymous memory lives, sampled from /proc/PID/smaps every `--every` seconds (issue 43:
the ~6.8 GB anonymous during Qwen-Image 20B's 60-block call under `--memory bounded`). Each sample sums Anonymous
and Rss by mapping kind: `heap` (glibc's main arena, brk), `arena64` (anonymous mappings of at most 64 MiB: glibc's
per-thread arenas and small mmaps), `big_mmap` (anonymous mappings above 64 MiB: allocations glibc maps one by one,
above its mmap threshold), `file` (file mappings: the weights ORT maps from external data), `other`. One JSON line a
sample; the largest mappings by Anonymous are listed at each sample.

    python experiments/families/anon_watch.py PID OUT.jsonl [--every 15]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
ARENA = 64 << 20


def sample(pid: int) -> dict | None:
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    kinds: dict[str, dict[str, int]] = {}
    largest = []
    cur = None
    for line in text.splitlines():
        m = HEAD.match(line)
        if m:
            start, end, name = int(m.group(1), 16), int(m.group(2), 16), m.group(3).strip()
            size = end - start
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("/"):
                kind = "file"
            elif name == "":
                kind = "arena64" if size <= ARENA else "big_mmap"
            else:
                kind = "other"
            cur = {"kind": kind, "size": size, "name": name[-40:]}
            continue
        if cur is None:
            continue
        key, _, val = line.partition(":")
        if key in ("Rss", "Anonymous"):
            kb = int(val.split()[0]) * 1024
            k = kinds.setdefault(cur["kind"], {"Rss": 0, "Anonymous": 0, "count": 0})
            k[key] += kb
            if key == "Rss":
                k["count"] += 1
            if key == "Anonymous" and kb:
                largest.append((kb, cur["kind"], cur["size"], cur["name"]))
    largest.sort(reverse=True)
    return {"t": round(time.time(), 1), "kinds": kinds,
            "largest_anon": [{"anon": a, "kind": k, "size": s, "name": n} for a, k, s, n in largest[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--every", type=float, default=15.0)
    a = ap.parse_args()
    with a.out.open("a") as f:
        while (s := sample(a.pid)) is not None:
            f.write(json.dumps(s) + "\n")
            f.flush()
            time.sleep(a.every)


if __name__ == "__main__":
    main()
