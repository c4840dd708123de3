"""ONNX models run on onnxruntime-web's WASM build in node: the page's kernels (the same .wasm file the browser
loads), without a browser. For checks that compare kernels across builds (tests/quantize/test_portable_rounding.py,
bench/web_drift.py): each model's outputs on identical inputs, x86 ONNX Runtime CPU vs WASM."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..errors import UserError
from .npm import installed

# reads jobs.json ([{model, inputs: [{name, dtype, shape, file}], out}]), runs each on the WASM provider (1 thread,
# graph optimizations as the page has them), writes each output's raw bytes and a list of them
RUNNER = """
import fs from "node:fs";
import { pathToFileURL } from "node:url";
const [ortFile, jobsFile] = process.argv.slice(2);
const ort = await import(pathToFileURL(ortFile).href);
ort.env.wasm.numThreads = 1;
const ARRAYS = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
                 uint8: Uint8Array, int8: Int8Array, bool: Uint8Array };
for (const job of JSON.parse(fs.readFileSync(jobsFile, "utf8"))) {
  const session = await ort.InferenceSession.create(fs.readFileSync(job.model), { executionProviders: ["wasm"] });
  const feeds = {};
  for (const i of job.inputs) {
    const b = fs.readFileSync(i.file), A = ARRAYS[i.dtype];
    feeds[i.name] = new ort.Tensor(i.dtype, new A(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)), i.shape);
  }
  const out = await session.run(feeds), listed = [];
  for (const [k, [name, t]] of Object.entries(Object.entries(out))) {
    fs.writeFileSync(`${job.out}.${k}`, Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength));
    listed.push({ name, dtype: t.type, shape: t.dims, file: `${job.out}.${k}` });
  }
  fs.writeFileSync(`${job.out}.json`, JSON.stringify(listed));
  await session.release();
}
"""
DTYPES = ("float32", "float64", "int64", "int32", "uint8", "int8", "bool")


def available() -> bool:
    return shutil.which("node") is not None and installed() is not None


def run_on_wasm(jobs: list[tuple[Path | bytes, dict[str, np.ndarray]]], timeout: float = 600) -> list[dict[str, np.ndarray]]:
    """[(model file or bytes, feeds)] -> [{output name: array}], run by onnxruntime-web's WASM build in node."""
    node, node_modules = shutil.which("node"), installed()
    if node is None or node_modules is None:
        raise UserError("running on onnxruntime-web needs node and the page's npm packages (make web-deps)")
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-wasm-") as tmp:
        tmp = Path(tmp)
        spec = []
        for j, (model, feeds) in enumerate(jobs):
            if isinstance(model, bytes):
                (tmp / f"m{j}.onnx").write_bytes(model)
                model = tmp / f"m{j}.onnx"
            inputs = []
            for k, (name, value) in enumerate(feeds.items()):
                value = np.ascontiguousarray(value)
                if value.dtype.name not in DTYPES:
                    raise UserError(f"run_on_wasm: input {name} has dtype {value.dtype}, not one of {', '.join(DTYPES)}")
                value.tofile(tmp / f"i{j}_{k}")
                inputs.append({"name": name, "dtype": value.dtype.name, "shape": list(value.shape), "file": str(tmp / f"i{j}_{k}")})
            spec.append({"model": str(model), "inputs": inputs, "out": str(tmp / f"o{j}")})
        (tmp / "jobs.json").write_text(json.dumps(spec))
        (tmp / "run.mjs").write_text(RUNNER)
        ort_file = node_modules / "onnxruntime-web" / "dist" / "ort.node.min.mjs"
        proc = subprocess.run([node, str(tmp / "run.mjs"), str(ort_file), str(tmp / "jobs.json")], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            raise UserError(f"onnxruntime-web (node) failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        results = []
        for j in range(len(jobs)):
            results.append({o["name"]: np.fromfile(o["file"], np.dtype(o["dtype"]))
                            .reshape(o["shape"]) for o in json.loads((tmp / f"o{j}.json").read_text())})
        return results
