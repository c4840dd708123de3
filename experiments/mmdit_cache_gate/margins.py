"""How close to its edge is each reference verdict?  For held-out prompts, the judge's logit margin (top class
minus the runner-up, smallest over the slots and heads the strict verdict reads) on the UNCACHED int8-static image,
and which cache settings flip the verdict.  Quality only.

    PYTHONPATH=src python experiments/mmdit_cache_gate/margins.py --int8 WORK [--items 0:32]
        [--specs residual:5,residual:5:0,residual:4:0,residual:3,residual:3:0] [--out experiments/mmdit_cache_gate/margins]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import schedules as sch  # noqa: E402  (puts src/ and bench/ on the path)
import tune_split  # noqa: E402

cp = sch.cp
from onnxdiffusion.evaluate import scenes as S  # noqa: E402
from onnxdiffusion.evaluate.judge import Judge  # noqa: E402
from onnxdiffusion.runtime import Pipeline  # noqa: E402


def margins(judge: Judge, images: np.ndarray, scenes) -> list[float]:
    """Per image: the smallest top-1 minus top-2 logit over what `strict` reads (every slot's shape head; colour
    and, when the caption names sizes, size at the prompted slots)."""
    x = images.astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    out = dict(zip(judge.output_names, judge.session.run(judge.output_names, {judge.input_name: x})))

    def gap(logits):
        top = np.sort(logits, axis=-1)
        return top[..., -1] - top[..., -2]

    res = []
    for i, sc in enumerate(scenes):
        slots = [S.POSITION_NAMES.index(o.position) for o in sc.objects]
        m = [gap(out["shape_logits"][i]).min(), gap(out["colour_logits"][i][slots]).min()]
        if sc.size_in_caption:
            m.append(gap(out["size_logits"][i][slots]).min())
        res.append(float(min(m)))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--int8", type=Path, required=True, metavar="WORK")
    ap.add_argument("--items", default="0:32")
    ap.add_argument("--specs", default="residual:5,residual:5:0,residual:4:0,residual:3,residual:3:0")
    ap.add_argument("--out", type=Path, default=HERE / "margins")
    args = ap.parse_args()
    start, count = map(int, args.items.split(":"))
    folder = cp.MODELS["mmdit"][0]
    pipe = Pipeline.from_folder(cp.int8_folder(folder, args.int8), threads=1)
    judge = Judge.from_file(threads=1)
    scenes, images, verdicts = tune_split.item_runners(pipe, judge, start, count)

    ref = images(None)
    want, margin = verdicts(ref), margins(judge, ref, scenes)
    flips = {}
    for spec in args.specs.split(","):
        got = verdicts(images(spec))
        flips[spec] = [start + int(i) for i in np.flatnonzero(got != want)]
        cp.log(f"{spec}: flipped {flips[spec]}")
    order = np.argsort(margin)
    state = {"items": args.items, "machine": cp.cpu_info(), "margin": margin, "strict": want.tolist(), "flips": flips}
    args.out.with_suffix(".json").write_text(json.dumps(state, indent=0) + "\n")
    lines = [f"# How close each reference verdict is to its edge (int8-static MMDiT, uncached, items {args.items})", "",
             f"CPU: {state['machine']['cpu']}. The judge's smallest logit margin (top class minus runner-up) over what "
             "the strict verdict reads, on the uncached int8-static image, lowest first; which cache settings flip "
             f"that prompt's verdict. Regenerate: `PYTHONPATH=src python experiments/mmdit_cache_gate/margins.py "
             f"--int8 WORK --items {args.items}`.", "",
             "| item | caption | strict (uncached) | margin (logits) | flipped by |", "|---:|---|---|---:|---|"]
    for i in order[:12]:
        item = start + int(i)
        by = ", ".join(f"`{s}`" for s, f in flips.items() if item in f) or "-"
        lines.append(f"| {item} | {scenes[i].caption} | {bool(want[i])} | {margin[i]:.2f} | {by} |")
    lines += ["", f"(The 12 lowest of {count}; median margin {np.median(margin):.1f} logits.)"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
