"""Run-time and fused LoRA vs diffusers' load_lora_weights + set_adapters on the tiny random pipelines of
SD, SDXL, SD3 and Flux (issue 23, acceptance 1): the numbers behind tests/test_lora*.py's thresholds. Host loop,
Loop and unrolled graphs (the backbone's adapter tensors as graph inputs) and the --whole graph (text encoders' too).

    PYTHONPATH=src python experiments/lora/parity.py WORK
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "models" / "training")]

CASES = {"one at 0.7": [("plain", 0.7)], "text encoder layers": [("text", 1.0)],
         "two at once": [("plain", 0.7), ("text", 0.5)]}
PROMPT = "a red circle on the left"


def build(name: str, root: Path) -> Path:
    import conftest
    import family_pipelines
    import tiny_families

    builders = {"sd": conftest.build_tiny_pipeline, "sdxl": family_pipelines.build_tiny_sdxl,
                "sd3": family_pipelines.build_tiny_sd3, "flux": tiny_families.build_tiny_flux}
    return builders[name](root)


def compile_graphs(points: Path, steps: int):
    """Loop, unrolled and whole graphs in the points folder; the whole graph's ORT session."""
    import onnxruntime as ort

    from onnxdiffusion.loopgraph.compile import compile_loop

    compile_loop(points, points, form="loop")
    compile_loop(points, points, form="unrolled", steps=steps)
    compile_loop(points, points, form="loop", whole=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(points / "sampler_loop_whole" / "model.onnx"), options,
                                providers=["CPUExecutionProvider"])


def graph_columns(pipe, whole, loras, kw: dict, host, ref) -> dict:
    """Loop / unrolled vs the host loop and diffusers; the whole graph vs the host loop (both with a negative
    prompt: the whole graph encodes its ids, where SDXL's host loop zeroes an absent one)."""
    from lora_helpers import run_whole_graph

    from onnxdiffusion.adapters.runtime import sampling_graph_inputs
    from onnxdiffusion.evaluate.metrics import psnr

    row = {}
    for form in ("loop", "unrolled"):
        got = pipe(PROMPT, loras=loras, loop=form, **kw)
        row[f"{form}_vs_host_db"], row[f"{form}_vs_diffusers_db"] = psnr(got.images, host.images), psnr(got.images, ref)
    neg = pipe(PROMPT, negative_prompt="a green ring", loras=loras, **kw)
    image = run_whole_graph(whole, pipe, neg, PROMPT, "a green ring", kw["steps"], kw["guidance"],
                            sampling_graph_inputs(pipe, loras))
    row["whole_vs_host_db"] = psnr(image, neg.images)
    return row


def main() -> None:
    from conftest import export_family
    from lora_helpers import diffusers_lora_images, make_lora

    from onnxdiffusion.adapters.folder import add_points
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.families import family_for_pipeline
    from onnxdiffusion.runtime import Pipeline

    work = Path(sys.argv[1])
    rows = []
    for name in sys.argv[2:] or ["sd", "sdxl", "sd3", "flux"]:
        root = work / name
        src = build(name, root)
        plain_dir = export_family(src, root / "onnx")
        add_points(plain_dir, root / "points")
        files = {"plain": make_lora(src, root / "plain", seed=11, std=0.2),
                 "text": make_lora(src, root / "text", seed=12, rank=8, alpha=4, text=True, std=0.2)}
        steps, guidance = (4, 3.5) if name == "flux" else (5, 5.0)
        kw = dict(steps=steps, guidance=guidance, seed=2, height=32, width=32)
        whole = compile_graphs(root / "points", steps)
        pipe, base = Pipeline.from_folder(root / "points"), Pipeline.from_folder(plain_dir)
        call = {"max_sequence_length": pipe.info["max_lengths"]["text_encoder_2"]} if name == "flux" else {}
        plain = pipe(PROMPT, **kw)
        identical = bool(np.array_equal(plain.images, base(PROMPT, **kw).images))
        fam = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"])
        for case, spec in CASES.items():
            loras = [(files[n], w) for n, w in spec]
            ours = pipe(PROMPT, loras=loras, **kw)
            ref = diffusers_lora_images(src, loras, PROMPT, ours.init_latents, steps, guidance, (32, 32), **call)
            row = {"family": name, "case": case, "runtime_vs_diffusers_db": psnr(ours.images, ref),
                   "lora_vs_plain_db": psnr(ours.images, plain.images), "no_adapter_identical": identical,
                   **graph_columns(pipe, whole, loras, kw, ours, ref)}
            if case == "two at once":
                names = (*(s.name for s in fam.text_encoders), fam.backbone, "vae_decoder")
                export_pipeline(src, root / "fused", ExportOptions(components=names, default_size=32,
                                                                  loras=tuple(loras)), progress=False)
                fused = Pipeline.from_folder(root / "fused")(PROMPT, **kw)
                row["fused_vs_diffusers_db"] = psnr(fused.images, ref)
            rows.append(row)
            print(row, flush=True)
    clean = [{k: ("inf" if isinstance(v, float) and v == float("inf") else v) for k, v in r.items()} for r in rows]
    (HERE / "parity.json").write_text(json.dumps(clean, indent=2) + "\n")  # inf: identical uint8 images
    lines = ["# LoRA parity with diffusers (tiny random pipelines, 32x32, PSNR of uint8 images; inf = identical)", "",
             "Host: the host loop. Loop / unrolled: the compiled sampling graphs, adapter tensors as graph inputs (the",
             "text encoders' layers in their sessions). Whole: `compile-loop --whole` run by onnxruntime alone, text",
             "encoders' layers inside the graph too (`sampling_graph_inputs`), against the host loop.", "",
             "| family | case | host vs diffusers | fused vs diffusers | Loop vs host | Loop vs diffusers | "
             "unrolled vs host | unrolled vs diffusers | whole vs host | LoRA vs plain | no adapter = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fused = f"{r['fused_vs_diffusers_db']:.1f}" if "fused_vs_diffusers_db" in r else "-"
        graphs = " | ".join(f"{r[k]:.1f}" for k in ("loop_vs_host_db", "loop_vs_diffusers_db", "unrolled_vs_host_db",
                                                   "unrolled_vs_diffusers_db", "whole_vs_host_db"))
        lines.append(f"| {r['family']} | {r['case']} | {r['runtime_vs_diffusers_db']:.1f} | {fused} | {graphs} | "
                     f"{r['lora_vs_plain_db']:.1f} | {'identical' if r['no_adapter_identical'] else 'DIFFERS'} |")
    (HERE / "parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
