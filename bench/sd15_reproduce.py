#!/usr/bin/env python
"""The bench verb's full-size run against the committed full-size figures: the same ratios side by side.

Reads a `results.json` written by

    onnxdiffusion bench --arch sd15 --quantize int8-static --isolate --threads 1 \\
        --variants torch-fp32,ort-fp32,ort-int8-static,openvino-int8-hybrid --out OUT

and the committed runs of experiments/sd15/sd15_int8_measure.py (bench/report_sd15/int8_static_threads1.json: int8-static
vs our fp32 vs diffusers eager, default memory; peers_quiet_threads1.json: int8-static `--memory lean` vs OpenVINO
int8-hybrid vs diffusers), and writes a markdown table (+ JSON) of each ratio: committed, this run, this / committed.

    python bench/sd15_reproduce.py OUT/results.json --out bench/report_sd15/reproduce_isolate
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "bench" / "report_sd15"


def _committed(same_machine: Path | None = None) -> dict:
    """name -> {e2e_cpu, e2e_wall, step_cpu, step_wall, peak} from the committed summaries, or from one
    sd15_int8_measure.py run (its fp32, int8-static, int8-static-lean, diffusers and OpenVINO rows) made on the
    machine the bench verb ran on."""
    if same_machine is not None:
        a = b = json.loads(Path(same_machine).read_text())["summary"]
    else:
        a = json.loads((REPORT / "int8_static_threads1.json").read_text())["summary"]
        b = json.loads((REPORT / "peers_quiet_threads1.json").read_text())["summary"]

    def row(s):
        return {"e2e_cpu": s.get("e2e_cpu_s"), "e2e_wall": s.get("e2e_wall_s"), "step_cpu": s.get("step_cpu_s"),
                "step_wall": s.get("step_wall_s"), "peak": s.get("peak_rss_bytes")}

    lean = next((k for k in b if "int8-static" in k and "lean" in k), None) or next(k for k in b if "int8-static" in k)
    return {"a": {"torch-fp32": row(a["diffusers-eager-fp32"]), "ort-fp32": row(a["fp32"]),
                  "ort-int8-static": row(a["int8-static"])},
            "b": {"torch-fp32": row(b["diffusers-eager-fp32"]), "ort-int8-static": row(b[lean]),
                  "openvino-int8-hybrid": row(b["openvino-int8-hybrid"])}}


def _ours(results: dict) -> dict:
    out = {}
    for r in results["variants"]:
        iso = r.get("isolated") or {}
        if r.get("status") == "ok" and iso:
            out[r["name"]] = {"e2e_cpu": iso.get("e2e_cpu_s"), "e2e_wall": iso.get("e2e_wall_s"),
                              "step_cpu": iso.get("step_cpu_s"), "step_wall": iso.get("step_wall_s"),
                              "peak": iso.get("peak_rss_bytes")}
    return out


# (label, committed set, numerator, denominator, measure)
RATIOS = [
    ("int8-static / diffusers eager fp32, end to end CPU", "a", "ort-int8-static", "torch-fp32", "e2e_cpu"),
    ("int8-static / diffusers eager fp32, end to end wall", "a", "ort-int8-static", "torch-fp32", "e2e_wall"),
    ("int8-static / our fp32, step CPU", "a", "ort-int8-static", "ort-fp32", "step_cpu"),
    ("int8-static / our fp32, step wall", "a", "ort-int8-static", "ort-fp32", "step_wall"),
    ("our fp32 / diffusers eager fp32, end to end CPU", "a", "ort-fp32", "torch-fp32", "e2e_cpu"),
    ("int8-static / diffusers eager fp32, peak RSS", "a", "ort-int8-static", "torch-fp32", "peak"),
    ("int8-static / our fp32, peak RSS", "a", "ort-int8-static", "ort-fp32", "peak"),
    ("int8-static / OpenVINO int8-hybrid, end to end CPU", "b", "ort-int8-static", "openvino-int8-hybrid", "e2e_cpu"),
    ("int8-static / OpenVINO int8-hybrid, end to end wall", "b", "ort-int8-static", "openvino-int8-hybrid", "e2e_wall"),
    ("int8-static / OpenVINO int8-hybrid, peak RSS", "b", "ort-int8-static", "openvino-int8-hybrid", "peak"),
]


def compare(results: dict, same_machine: Path | None = None) -> list[dict]:
    committed, ours = _committed(same_machine), _ours(results)
    sources = ({"a": same_machine.name, "b": f"{same_machine.name} (int8 lean)"} if same_machine is not None else
               {"a": "int8_static_threads1.json", "b": "peers_quiet_threads1.json (int8 lean)"})
    rows = []
    for label, which, num, den, key in RATIOS:
        def ratio(d):
            a, b = (d.get(num) or {}).get(key), (d.get(den) or {}).get(key)
            return a / b if a and b else None

        c, o = ratio(committed[which]), ratio(ours)
        rows.append({"ratio": label, "committed": c, "this_run": o, "this_over_committed": o / c if c and o else None,
                     "committed_from": sources[which]})
    return rows


def markdown(rows: list[dict], results: dict, same_machine: Path | None = None) -> str:
    m = results.get("machine", {})
    isa = m.get("cpu_isa") or []
    isa = isa.get("isa_flags", []) if isinstance(isa, dict) else isa  # bench.machine.isa_summary's record, or a list
    f = lambda x: f"{x:.2f}x" if x is not None else "n/a"  # noqa: E731
    lines = [f"`onnxdiffusion bench --arch sd15 --quantize int8-static --isolate --threads 1` "
             f"({results['settings']['repeats']} interleaved rounds, {m.get('cpu')} ({', '.join(isa) or 'ISA not recorded'}), "
             f"{m.get('cpus')} cores, load average "
             f"{' '.join(m.get('loadavg') or [])} at the start, {' '.join(m.get('loadavg_end') or [])} at the end) "
             + ("vs experiments/sd15/sd15_int8_measure.py run on the same machine "
                f"(`{same_machine.name}`; 'committed' below = that run):" if same_machine is not None
                else "vs the committed experiments/sd15/sd15_int8_measure.py runs:"), "",
             "| ratio (below 1: the first is faster / smaller) | committed | this run | this / committed | committed in |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['ratio']} | {f(r['committed'])} | {f(r['this_run'])} | {f(r['this_over_committed'])} | "
                     f"{r['committed_from']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--same-machine", type=Path, metavar="MEASURE_JSON",
                    help="compare with this sd15_int8_measure.py results file (run beside the verb) instead of the "
                         "committed figures")
    args = ap.parse_args()
    results = json.loads(args.results.read_text())
    rows = compare(results, args.same_machine)
    md = markdown(rows, results, args.same_machine)
    print(md)
    if args.out:
        args.out.with_suffix(".md").write_text(md)
        args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "machine": results.get("machine"),
                                                             "settings": results.get("settings")}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
