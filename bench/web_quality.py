"""The page's images vs `generate`'s: every variant of bench/web_table.py (fp32, int8-static with rounding=cpu
(int8) and rounding=portable (int8p), for both embedded models), six prompts at the model's defaults, in headless Chromium (WASM, 1 thread). For int8 it also says how
far each image is from the fp32 `generate` image, for the page and for `generate` itself.

    python bench/web_quality.py --work DIR [--out bench/results/web_quality]   # DIR: web_table.py's --work
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
PROMPTS = ["a small red circle on the left", "a blue star above a yellow square", "two green triangles",
           "a purple ring in the middle", "a big orange square on the right", "a yellow star below a red circle"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "web_quality")
    a = ap.parse_args()
    from web_table import compact_json, cpu_name, variants

    from onnxdiffusion.bench.setup import machine_info
    from onnxdiffusion.evaluate.metrics import psnr
    from onnxdiffusion.runtime import Pipeline
    from onnxdiffusion.web import export_web
    from onnxdiffusion.web.browser import chrome, generate, open_page, static_server

    models = variants(a.work, lambda s: print(s, file=sys.stderr))
    rows = {}
    d = chrome()
    try:
        for name, model in models.items():
            page = a.work / f"page-{name}"
            if not (page / "settings.json").is_file():
                export_web(model, page, overwrite=True, allow_drift=True)
            pipe = Pipeline.from_folder(model)
            fp32 = Pipeline.from_folder(models[name.split("-")[0] + "-fp32"])
            with static_server(page) as url:
                assert open_page(d, url) == "ready"
                out = []
                for seed, prompt in enumerate(PROMPTS):
                    r = generate(d, prompt, seed, a.steps)
                    assert r["status"] == "done", r["status"]
                    want = pipe(prompt, seed=seed, steps=a.steps).images[0]
                    ref = fp32(prompt, seed=seed, steps=a.steps).images[0]
                    out.append({"page_vs_generate": psnr(r["image"], want), "page_vs_fp32": psnr(r["image"], ref),
                                "generate_vs_fp32": psnr(want, ref)})
            rows[name] = out
            print(name, [round(x["page_vs_generate"], 1) for x in out], file=sys.stderr, flush=True)
    finally:
        d.quit()
    fmt = lambda xs: f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"  # noqa: E731
    lines = [f"# The page's image vs `generate` (PSNR dB, min / median / max over {len(PROMPTS)} prompts, seeds 0-5, "
             f"{a.steps} steps, model defaults)", "",
             f"CPU: {cpu_name()}, load average at the end {' '.join(machine_info().get('loadavg', []))}; headless Chromium, "
             "onnxruntime-web WASM 1 thread. inf = identical. int8: int8-static rounding=cpu (export-web --allow-drift); "
             "int8p: rounding=portable.", "",
             "| variant | page vs generate | prompts >= 40 dB | page vs fp32 generate | generate vs fp32 generate |",
             "|---|---|---|---|---|"]
    for name, out in rows.items():
        pg = [x["page_vs_generate"] for x in out]
        lines.append(f"| {name} | {fmt(pg)} | {sum(x >= 40 for x in pg)}/{len(pg)} | "
                     f"{fmt([x['page_vs_fp32'] for x in out])} | {fmt([x['generate_vs_fp32'] for x in out])} |")
    per = {n: ", ".join(f"{x['page_vs_generate']:.1f}" for x in out) for n, out in rows.items()}
    lines += ["", "Per prompt (page vs generate): " + "; ".join(f"{n}: {v}" for n, v in per.items())]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(compact_json({"machine": machine_info(), "steps": a.steps, "prompts": PROMPTS,
                                                        "rows": rows}))
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
