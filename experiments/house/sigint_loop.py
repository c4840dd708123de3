"""Issue 41's flake in a loop: `python -m onnxdiffusion.cli export` of the tiny pipeline, SIGINT a set delay after
'export' appears (test_signals' export-1 case), alternating between two source trees run for run so both see the
same machine load. A run fails unless it exits 130 with one `error: interrupted` line, no traceback and nothing
left in the output folder or TMPDIR.

    python experiments/house/sigint_loop.py --before BASELINE/src --after src -n 40 --delays 0.3,0.6,1.0,1.5

The tiny pipeline is built once into --work (tests/conftest.py's builder). Each delay is run by both trees in turn.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tiny(work: Path) -> Path:
    folder = work / "tiny"
    if not (folder / "diffusers" / "model_index.json").is_file():
        sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "models" / "training"), str(ROOT / "src")]
        from conftest import build_tiny_pipeline

        build_tiny_pipeline(folder)
    return folder / "diffusers"


def one_run(src: str, tiny: Path, work: Path, delay: float) -> tuple[int | None, bool, str]:
    """(exit status, whether everything the test asserts held, the stderr's tail)."""
    tmp = Path(tempfile.mkdtemp(prefix="sigint-loop-", dir=work))
    out, scratch, err_path = tmp / "work", tmp / "tmpdir", tmp / "stderr.txt"
    out.mkdir()
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "HF_HUB_OFFLINE": "1", "PYTHONPATH": src}
    env.pop("TQDM_DISABLE", None)  # the progress bar is the readiness signal
    try:
        with open(err_path, "w") as err:
            proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "onnxdiffusion.cli", "export",
                                     str(tiny), str(out / "out"), "--no-validate"], stdout=subprocess.DEVNULL,
                                    stderr=err, env=env, cwd=out,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            while proc.poll() is None and "export" not in err_path.read_text(errors="replace"):
                time.sleep(0.05)
            time.sleep(delay)
            if proc.poll() is not None:
                return None, False, "finished before the signal"
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        text = err_path.read_text(errors="replace")
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        left = list(out.iterdir()) + [p for p in scratch.iterdir() if p.is_dir() or p.name.startswith(("onnxd", "tmp"))]
        ok = proc.returncode == 130 and "Traceback" not in text and errors == ["error: interrupted"] and not left
        return proc.returncode, ok, text[-600:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the baseline's src folder")
    ap.add_argument("--after", required=True, help="the fixed src folder")
    ap.add_argument("-n", type=int, default=40, help="runs in all (half per tree)")
    ap.add_argument("--delays", default="0.3", help="seconds after 'export', comma-separated, each run by both")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sigint-loop"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tiny = _tiny(work)
    delays = [float(d) for d in args.delays.split(",")]
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    counts: dict[str, collections.Counter] = {k: collections.Counter() for k in trees}
    for i in range(args.n):
        name = ("before", "after")[i % 2]
        delay = delays[(i // 2) % len(delays)]
        rc, ok, tail = one_run(trees[name], tiny, work, delay)
        counts[name]["runs"] += 1
        counts[name]["failed"] += not ok
        counts[name][f"rc={rc}"] += 1
        if not ok:
            print(f"run {i} ({name}, {delay} s): rc={rc}\n{tail}", flush=True)
        print(i, {k: dict(v) for k, v in counts.items()}, flush=True)
    for name, c in counts.items():
        print(f"{name}: {c['failed']}/{c['runs']} failed", dict(c))


if __name__ == "__main__":
    main()
