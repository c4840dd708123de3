#!/usr/bin/env bash
# Issue 46 acceptance 4 in one command, on a machine of another CPU kind (an AMX Xeon where the runs so far had
# AVX-512 VNNI, or the reverse): the four acceptance runs (both embedded models x --min-psnr 35 / --keep-accuracy,
# each in a 20-minute budget, each with a fresh store), a re-run of the first with its store (acceptance 3), then
# the table (collect.py) and each report's machine and why sections side by side in OUT/why.md.
#
#   bash experiments/tune/other_cpu.sh OUT [BUDGET_MIN]
#   DRY_RUN=1 bash ...: print the commands only; COLLECT_ONLY=1 bash ...: only the table and why.md from the runs
#   already in OUT (a session cut short)
#
# Run it from any directory; it uses the checkout it lives in, its .venv (PYTHON=... to use another) and
# HF_HUB_OFFLINE=1. About 100 minutes at the default budget. For the openvino profiles to be timed (the expected
# choice on AMX: experiments/amx), onnxruntime-openvino must be the onnxruntime of that venv; without it each report
# lists the openvino profiles as refused, with the reason, and OUT/machine.json says which providers there were.
set -euo pipefail

OUT=${1:?usage: bash experiments/tune/other_cpu.sh OUT [BUDGET_MIN]}
BUDGET=${2:-20}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT/src HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)

run() {  # run NAME CACHE MODEL BOUND...: one tune run, its wall clock (time.txt) and load (load.txt) kept beside it
    local name=$1 cache=$2 model=$3
    shift 3
    local cmd=("$PY" -m onnxdiffusion.cli tune "$ROOT/$model" "$OUT/$name" "$@" --time-budget "$BUDGET")
    if [[ -n "${DRY_RUN:-}" ]]; then
        echo "ONNXDIFFUSION_CACHE=$OUT/$cache ${cmd[*]}"
        return
    fi
    echo "$(date -u +%T) $name: ${cmd[*]}" >&2
    (while sleep 30; do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; done) > "$OUT/logs/$name.load" &
    local logger=$!
    local rc=0
    ONNXDIFFUSION_CACHE=$OUT/$cache /usr/bin/time -v -o "$OUT/logs/$name.time" "${cmd[@]}" \
        2> "$OUT/logs/$name.log" || rc=$?
    kill "$logger" 2> /dev/null || true
    if [[ -d "$OUT/$name" ]]; then  # (tune writes only into an empty OUT: these go in after it)
        cp "$OUT/logs/$name.time" "$OUT/$name/time.txt"
        cp "$OUT/logs/$name.load" "$OUT/$name/load.txt"
        cp "$OUT/logs/$name.log" "$OUT/$name/log.txt"
    fi
    echo "$(date -u +%T) $name: exit $rc" >&2
}

if [[ -z "${DRY_RUN:-}" && -z "${COLLECT_ONLY:-}" ]]; then
    lscpu > "$OUT/lscpu.txt" 2>&1 || true
    "$PY" - > "$OUT/machine.json" <<'EOF'
import json
from onnxdiffusion.bench.machine import machine_facts
from onnxdiffusion.tune.machine import session_facts
from onnxdiffusion.tune.builds import plan, profiles_for
ok, refused, _ = profiles_for("int8")
print(json.dumps({**machine_facts(), "session": session_facts(), "int8_profiles": list(ok),
                  "int8_profiles_refused": refused,
                  "int8_static_builds": {b.name: list(b.for_profiles) for b in plan("int8-static")}}, indent=1))
EOF
    cat "$OUT/machine.json" >&2
fi

if [[ -z "${COLLECT_ONLY:-}" ]]; then
    run sd-psnr35 cache-sd-psnr35 models/shapes-sd-onnx --min-psnr 35
    run sd-keep cache-sd-keep models/shapes-sd-onnx --keep-accuracy
    run mmdit-psnr35 cache-mmdit-psnr35 models/shapes-mmdit-onnx --min-psnr 35
    run mmdit-keep cache-mmdit-keep models/shapes-mmdit-onnx --keep-accuracy
    run sd-psnr35-rerun cache-sd-psnr35 models/shapes-sd-onnx --min-psnr 35  # acceptance 3: the same store
fi

[[ -n "${DRY_RUN:-}" ]] && exit 0
runs=()
for name in sd-psnr35 sd-keep mmdit-psnr35 mmdit-keep sd-psnr35-rerun; do
    [[ -f "$OUT/$name/tune.json" ]] && runs+=("$OUT/$name")
done
if (( ${#runs[@]} )); then
    "$PY" "$ROOT/experiments/tune/collect.py" "${runs[@]}" > "$OUT/table.md"
fi
{
    echo "# tune on $(grep -m1 'Model name' "$OUT/lscpu.txt" 2> /dev/null | cut -d: -f2- | xargs): machine and why, per run"
    for run_dir in "${runs[@]}"; do
        echo
        echo "## $(basename "$run_dir")"
        echo
        grep -m1 '^\*\*Chosen' "$run_dir/report.md" || true
        echo
        sed -n '/^## Machine/,/^Bound:/p' "$run_dir/report.md" | sed '$d' | sed 's/^## /### /'
        sed -n '/^## Why this choice/,/^!\[/p' "$run_dir/report.md" | sed '$d' | sed 's/^## /### /'
    done
} > "$OUT/why.md"
echo "wrote $OUT/table.md and $OUT/why.md" >&2
