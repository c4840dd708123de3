// Runs a page folder's pipeline (page/pipeline.js) in node on the folder's own onnxruntime-web WASM build:
//   node run_page.mjs PAGE_FOLDER REQUESTS.json OUT_PREFIX [THREADS]
// REQUESTS.json: a list of {prompt, negative, seed, steps, guidance, sampler, image?}; image (an editing page's
// picture): {file: raw uint8 RGB(A) bytes, width, height}; writes OUT_PREFIX<i>.rgb (uint8
// HWC) per request and OUT_PREFIX.json ({load_ms, results: [{width, height, notices, timings} | {error}]}).
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [page, requestsFile, outPrefix, threads = "1"] = process.argv.slice(2);
const url = (p) => pathToFileURL(path.resolve(page, p)).href;
const settings = JSON.parse(fs.readFileSync(path.join(page, "settings.json"), "utf8"));
const ort = await import(url(`ort/${settings.runtime.wasm}`));
ort.env.wasm.wasmPaths = url("ort/") + "/";
ort.env.wasm.numThreads = Number(threads);
const { Tokenizer } = await import(url("lib/tokenizers.min.mjs"));
const { WebPipeline } = await import(url("pipeline.js"));
const load = async (p) => { const b = fs.readFileSync(path.join(page, p)); return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); };
const t0 = performance.now();
const pipe = await WebPipeline.load({ ort, Tokenizer, load });
const loadMs = performance.now() - t0;
const results = [];
const requests = JSON.parse(fs.readFileSync(requestsFile, "utf8"));
for (let i = 0; i < requests.length; i++) {
  try {
    const req = { ...requests[i] };
    if (req.image) req.image = { ...req.image, data: new Uint8Array(fs.readFileSync(req.image.file)) };
    const r = await pipe.generate(req);
    fs.writeFileSync(`${outPrefix}${i}.rgb`, Buffer.from(r.image.buffer, r.image.byteOffset, r.image.byteLength));
    results.push({ width: r.width, height: r.height, notices: r.notices, timings: r.timings, model_evaluations: r.model_evaluations });
  } catch (e) {
    results.push({ error: String(e.message || e) });
  }
}
fs.writeFileSync(`${outPrefix}.json`, JSON.stringify({ load_ms: loadMs, results }));
process.exit(0);
