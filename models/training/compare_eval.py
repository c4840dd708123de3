"""Does a retrained model reproduce the shipped one? Compares two eval.json files (same held-out pairs,
sampler, steps and guidance) and writes the comparison as JSON.

    python models/training/compare_eval.py models/shapes-mmdit/eval.json runs/repro-mmdit/model/eval.json \
        --out models/training/reproduction_mmdit.json --what "make model-mmdit, ..." --tolerance 0.03

Exit status 1 when an accuracy differs by more than the tolerance (3 points by default) or the two evaluations
were not run with the same options; the Frechet distance is reported, not judged (it moves with the sample).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ACCURACIES = ("attribute_accuracy", "strict_accuracy", "position_accuracy", "shape_accuracy", "colour_accuracy",
              "size_accuracy")
SAME_OPTIONS = ("count", "steps", "sampler", "guidance", "split", "seed_offset")


def compare(shipped: dict, retrained: dict, tolerance: float) -> dict:
    a, b = shipped.get("options", {}), retrained.get("options", {})
    mismatched = [k for k in SAME_OPTIONS if a.get(k) != b.get(k)]
    rows = {}
    for k in ACCURACIES + ("frechet_distance",):
        if k in shipped and k in retrained:
            rows[k] = {"shipped": shipped[k], "retrained": retrained[k], "delta": retrained[k] - shipped[k]}
    worst = max((abs(rows[k]["delta"]) for k in ACCURACIES if k in rows), default=float("inf"))
    return {
        "options": {k: a.get(k) for k in SAME_OPTIONS},
        "options_mismatched": mismatched,
        "metrics": rows,
        "largest_accuracy_delta": worst,
        "tolerance": tolerance,
        "reproduces": not mismatched and worst <= tolerance,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shipped", type=Path)
    ap.add_argument("retrained", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.03, help="largest accuracy difference (fraction)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--what", default="", help="how the retrained model was made (command, commit, time)")
    args = ap.parse_args(argv)
    try:
        shipped, retrained = (json.loads(p.read_text()) for p in (args.shipped, args.retrained))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"what": args.what, **compare(shipped, retrained, args.tolerance)}
    for k, r in result["metrics"].items():
        print(f"{k:20s} shipped {r['shipped']:8.4f}  retrained {r['retrained']:8.4f}  delta {r['delta']:+.4f}")
    if result["options_mismatched"]:
        print(f"options differ: {', '.join(result['options_mismatched'])}")
    print(f"reproduces within {args.tolerance:.3f}: {result['reproduces']}")
    if args.out:
        tmp = args.out.with_suffix(".part")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, args.out)
    return 0 if result["reproduces"] else 1


if __name__ == "__main__":
    sys.exit(main())
