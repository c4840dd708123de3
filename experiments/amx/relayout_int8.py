#!/usr/bin/env python
"""An existing int8-static folder with its convolutions laid out for this CPU, without re-quantizing.

The same code `quantize --recipe int8-static -O kernels=auto|amx` runs after its build
(quantize/amx_lowering.apply on the stored CPU-fused backbone), applied to a folder quantized before the
option (or with kernels=portable): every file hard-linked except the backbone graph, which gets the
lowering; its weights file is linked unchanged (the rewrite touches nodes and adds tiny initializers only),
the manifest records the choice and is rehashed. For the full-size (> 2 GB) measurement, where a second
quantization costs ~9 GB and 6+ minutes for the same calibration.

    python experiments/amx/relayout_int8.py $WORK/int8-static $WORK/int8-static-amx --kernels auto
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import onnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from onnxdiffusion.folder.artifacts import (MANIFEST, atomic_dir, hash_tree, link_files, read_manifest, write_json)  # noqa: E402
from onnxdiffusion.families import get_family  # noqa: E402
from onnxdiffusion.onnxio import files  # noqa: E402
from onnxdiffusion.quantize.amx_lowering import apply  # noqa: E402
from onnxdiffusion.quantize.report import component_feed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--kernels", default="auto", choices=("auto", "amx"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    manifest = read_manifest(args.src)
    family = get_family(manifest.get("family"))
    name = family.backbone
    info = manifest["components"][name]
    if info.get("int8_kernels", {}).get("lowered"):
        raise SystemExit(f"{args.src}: already laid out ({info['int8_kernels']['target']})")
    graph_rel = info["path"]
    model = files.load_backbone(args.src / graph_rel)
    feed = component_feed(name, manifest)  # the folder's default size, batch 2 (one guided pair)
    calib = SimpleNamespace(num_steps=1, feed=lambda step, rows: feed)
    ctx = SimpleNamespace(get_calibration=lambda: calib, threads=args.threads, log=lambda m: print(m, flush=True))
    record = apply(ctx, args.kernels, model)
    files._drop_key(model)  # the skeleton's data folder: not written into the graph
    with atomic_dir(args.out, inputs=(args.src,)) as tmp:
        link_files(args.src, tmp, [rel for rel in manifest["files"] if rel != graph_rel])
        onnx.save_model(model, str(tmp / graph_rel))  # weights stay in the linked external-data file(s)
        new = json.loads(json.dumps(manifest))
        new["components"][name]["int8_kernels"] = record
        new["files"] = hash_tree(tmp)
        write_json(tmp / MANIFEST, new)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
