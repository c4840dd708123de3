"""Happy-path cost of the hardening checks (issue 15, acceptance 5): `generate` on the embedded model,
the code before vs after, interleaved rounds in fresh processes, medians.

    python experiments/hardening/harden_overhead.py --before <git-ref> [--rounds 8] [--calls 10]

Each round starts one worker per side (alternating which goes first). A worker imports onnxdiffusion
from its own source tree, warms up once, then times `calls` in-process CLI invocations of
`generate MODEL PROMPT --steps 20 --guidance 4.0 -o <new file>` (load + validate + sample + decode +
save: everything a user waits for except the interpreter start) and `calls` bare `Pipeline.__call__`s
(the sampling loop alone), each as wall time and as process CPU time (all threads; far less sensitive
to other load on a shared machine). Prints per-side medians over all calls and the after/before ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import contextlib, io, json, sys, tempfile, time
from pathlib import Path
calls = int(sys.argv[1])
from onnxdiffusion.cli import app
from onnxdiffusion.folder.paths import default_model_folder
from onnxdiffusion.runtime import Pipeline
model = default_model_folder()
out = Path(tempfile.mkdtemp())
def cli(i):
    argv = ["generate", str(model), "a red circle on the left", "--steps", "20", "--guidance", "4.0", "--seed", "1",
            "-o", str(out / f"img{i}.png")]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        app(args=argv, standalone_mode=False)
cli(-1)
e2e, e2e_cpu = [], []
for i in range(calls):
    t, c = time.perf_counter(), time.process_time(); cli(i)
    e2e.append(time.perf_counter() - t); e2e_cpu.append(time.process_time() - c)
pipe = Pipeline.from_folder(model)
pipe("a red circle on the left", steps=20, guidance=4.0, seed=1)
loop, loop_cpu = [], []
for i in range(calls):
    t, c = time.perf_counter(), time.process_time()
    pipe("a red circle on the left", steps=20, guidance=4.0, seed=1)
    loop.append(time.perf_counter() - t); loop_cpu.append(time.process_time() - c)
print(json.dumps({"e2e": e2e, "loop": loop, "e2e_cpu": e2e_cpu, "loop_cpu": loop_cpu}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="git ref of the code before the change")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", args.before, "src"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        sides = {"before": before / "src", "after": repo / "src"}
        env_models = str(repo / "models")
        samples: dict = {k: {"e2e": [], "loop": [], "e2e_cpu": [], "loop_cpu": []} for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                env = {"PYTHONPATH": str(sides[side]), "ONNXDIFFUSION_MODELS": env_models, "HF_HUB_OFFLINE": "1",
                       "TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin"}
                res = subprocess.run([sys.executable, "-c", WORKER, str(args.calls)], env=env, capture_output=True,
                                     text=True, check=True)
                got = json.loads(res.stdout.strip().splitlines()[-1])
                for k in got:
                    samples[side][k] += got[k]
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    rows = {}
    for k in ("e2e", "loop", "e2e_cpu", "loop_cpu"):
        b, a = statistics.median(samples["before"][k]), statistics.median(samples["after"][k])
        rows[k] = {"before_ms": round(b * 1e3, 2), "after_ms": round(a * 1e3, 2), "ratio": round(a / b, 4),
                   "n": len(samples["after"][k])}
    print(json.dumps({"before": args.before, "rounds": args.rounds, "calls": args.calls, **rows}, indent=2))
    print("| measure | before ms | after ms | after/before |\n|---|---|---|---|")
    for k, label in (("e2e", "CLI generate (load+validate+sample+save), wall"), ("loop", "Pipeline call, wall"),
                     ("e2e_cpu", "CLI generate, process CPU time"), ("loop_cpu", "Pipeline call, process CPU time")):
        print(f"| {label} | {rows[k]['before_ms']} | {rows[k]['after_ms']} | {rows[k]['ratio']} |")


if __name__ == "__main__":
    main()
