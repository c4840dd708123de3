#!/usr/bin/env python
"""Table and plot of a full-size run of experiments/sd15/sd15_int8_measure.py (our paths beside the peers).

    python experiments/amx/quiet_table.py experiments/amx/results/sd15_quiet_threads1.json

writes RESULTS.md and RESULTS.png beside it: per variant the median backbone step and end-to-end time (process CPU
seconds for ours and diffusers, the worker's own figures for OpenVINO's pipeline: wall step incl. its scheduler, CPU
end to end), peak RSS, load + first call, and the ratios to diffusers eager bf16, OpenVINO int8-hybrid and today's
int8-static.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {
    "fp32": "ours fp32 (ORT CPU)",
    "int8-static": "ours int8-static, kernels=portable (ORT CPU)",
    "int8-static-amx": "ours int8-static, kernels=auto: AMX layout (ORT CPU)",
    "int8-qdq-openvino-provider": "ours int8-static stored=qdq, --profile openvino-int8 (bf16 float parts)",
    "int8-qdq-openvino-static": "ours int8-static stored=qdq, --profile openvino-int8: static backbone shapes (bf16)",
    "int8-qdq-openvino-dynamic": "ours int8-static stored=qdq, openvino-int8 with static_shapes: false (bf16)",
    "fp32-openvino-provider": "ours fp32 (--no-fuse-attention), --profile openvino-fp32 (bf16)",
    "openvino-int8-hybrid": "OpenVINO's pipeline, int8-hybrid (optimum-intel)",
    "openvino-fp32": "OpenVINO's pipeline, fp32",
    "sdcpp-q8_0": "stable-diffusion.cpp q8_0",
    "diffusers-eager-fp32": "diffusers eager fp32",
    "diffusers-eager-bf16": "diffusers eager bf16",
}


def main() -> int:
    path = Path(sys.argv[1])
    d = json.loads(path.read_text())
    s, raw = d["summary"], d["raw"]
    cpu = d["machine"]["cpu"]

    def step(k):
        v = s[k]
        return v["step_cpu_s"] if v.get("step_cpu_s") is not None else v["step_wall_s"]

    ref = {key: (s.get(name) or {}).get("e2e_cpu_s") for key, name in
           (("bf16", "diffusers-eager-bf16"), ("ov", "openvino-int8-hybrid"), ("today", "int8-static"))}

    def ratio(key, e2e):
        return f"{ref[key] / e2e:.2f}x" if ref[key] else "-"
    lines = [f"### Full size (SD1.5 architecture, random weights), 256x256, DDIM 10, guidance 7.5, 1 thread",
             "", f"Machine: {cpu['model']}, {cpu['cores']} cores, ISA {' '.join(cpu['isa_flags'])} (int8 kernels: "
             f"{cpu['int8_kernels']}); onnxruntime {d['machine']['onnxruntime']}; load {d['machine']['loadavg']} at the "
             f"start; {d['settings']['rounds']} interleaved rounds, fresh process per variant and round, medians.", "",
             "| variant | step s | step vs today's int8-static | end to end, CPU s | vs diffusers bf16 | vs OpenVINO int8-hybrid | vs today's int8-static | "
             "peak RSS GB | load + first call, wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for k, v in s.items():
        if "error" in v:
            continue
        e2e = v["e2e_cpu_s"]
        first = [r.get("load_wall_s", 0) + r.get("warmup_call_wall_s", 0) for r in raw[k] if "error" not in r]
        rows.append((k, step(k), e2e))
        step_ratio = f"{step('int8-static') / step(k):.2f}x" if "int8-static" in s else "-"
        lines.append(f"| {LABELS.get(k, k)} | {step(k):.2f} | {step_ratio} | {e2e:.1f} | {ratio('bf16', e2e)} | {ratio('ov', e2e)} | "
                     f"{ratio('today', e2e)} | {v['peak_rss_bytes'] / 1e9:.2f} | {min(first):.1f} |")
    second = {k: v["e2e_second_cpu_s"] for k, v in s.items() if v.get("e2e_second_cpu_s") is not None}
    if second:
        lines += ["", "Second image in the same process (what a served pipeline pays per image), CPU s: "
                  + "; ".join(f"{LABELS.get(k, k)} {e:.1f}" for k, e in second.items())
                  + (f" (OpenVINO's pipeline compiles at load: its one image is steady-state). Ratios on it: "
                     + "; ".join(f"{LABELS.get(k, k)}: {second['diffusers-eager-bf16'] / e:.2f}x diffusers bf16, "
                                 f"{ref['ov'] / e:.2f}x OpenVINO int8-hybrid" for k, e in second.items()
                                 if not k.startswith("diffusers"))
                     if "diffusers-eager-bf16" in second and ref["ov"] else "")]
    lines += ["", "Step: one backbone call on a fixed batch-2 feed, process CPU s (OpenVINO's pipeline: its sampling step, "
              "UNet pair + scheduler, wall). Ratios: the other's end-to-end CPU s / this row's (> 1: this row is faster). "
              "Load + first call: the session's load and its first (warm-up) call, wall (OpenVINO compiles there); "
              "OpenVINO's pipeline: its load from the converted IR (conversion not counted)."]
    out_md = path.with_suffix(".md")
    out_md.write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows.sort(key=lambda r: r[2])
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ours = [not k.startswith(("openvino-", "diffusers")) for k, _, _ in rows]
    ax.barh([LABELS.get(k, k) for k, _, _ in rows], [e for _, _, e in rows], color=["tab:blue" if o else "tab:gray" for o in ours])
    for i, (_, _, e) in enumerate(rows):
        ax.text(e, i, f" {e:.1f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("end to end, CPU s (1 thread; lower is faster)")
    ax.set_title(f"SD1.5-size, 256x256, 10 steps: {cpu['model']} ({cpu['int8_kernels']})", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.subplots_adjust(left=0.45, right=0.97, bottom=0.13, top=0.92)
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(out_md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
