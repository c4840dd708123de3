// The page: loads the runtime and the graph, then prompt in -> image out.
// Test contract (tests and automated checks rely on these names): inputs #prompt, #seed, #steps, button
// #generate (an editing model's page: the picture to edit in the file input #picture); while it runs #status reads "sampling: step i/n" per denoising step (#progress follows); when an
// image is ready <img id="result"> holds a PNG data URL and #status reads "done" ("error: ..." on failure).
// document.body.dataset after a run: runMs, totalMs, steps, stepMs (median ms per step), stepTimes (each step, ms).
// URL options: ?ep=wasm|webgpu (default: webgpu when the browser offers it and the folder has it),
// ?threads=N (default: all cores when the page is cross-origin isolated, else 1).

import { WebPipeline, InputError } from "./pipeline.js";
import { Tokenizer } from "./lib/tokenizers.min.mjs";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
let pipeline = null;
let busy = false;

function status(text, error = false) {
  $("status").textContent = error ? `error: ${text}` : text;
  $("status").className = error ? "error" : "";
}

async function load(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.arrayBuffer();
}

async function chooseRuntime(settings) {
  const want = params.get("ep");
  const gpu = settings.runtime.webgpu && "gpu" in navigator && want !== "wasm" && await navigator.gpu.requestAdapter().then((a) => !!a, () => false);
  if (want === "webgpu" && !gpu) throw new Error("WebGPU was asked for (?ep=webgpu) but this browser or folder does not offer it");
  const ort = await import(gpu ? `./ort/${settings.runtime.webgpu}` : `./ort/${settings.runtime.wasm}`);
  ort.env.wasm.wasmPaths = new URL("./ort/", location.href).href;
  const cores = navigator.hardwareConcurrency || 1;
  const threads = params.has("threads") ? Math.max(1, Number(params.get("threads")) | 0) : (crossOriginIsolated ? cores : 1);
  ort.env.wasm.numThreads = crossOriginIsolated ? threads : 1;
  ort.env.wasm.simd = true;
  ort.env.wasm.proxy = params.get("proxy") !== "0";  // run in a worker: the page stays live during the run
  return { ort, ep: gpu ? ["webgpu", "wasm"] : ["wasm"], threads: ort.env.wasm.numThreads };
}

function toDataURL(image, width, height) {
  const canvas = document.createElement("canvas");
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const rgba = ctx.createImageData(width, height);
  for (let i = 0, j = 0; i < width * height; i++, j += 4) {
    rgba.data[j] = image[3 * i];
    rgba.data[j + 1] = image[3 * i + 1];
    rgba.data[j + 2] = image[3 * i + 2];
    rgba.data[j + 3] = 255;
  }
  ctx.putImageData(rgba, 0, 0);
  return canvas.toDataURL("image/png");
}

async function start() {
  const t0 = performance.now();
  const settings = JSON.parse(new TextDecoder().decode(await load("settings.json")));
  const { ort, ep, threads } = await chooseRuntime(settings);
  pipeline = await WebPipeline.load({ ort, Tokenizer, load, sessionOptions: { executionProviders: ep }, onStatus: status });
  const d = settings.defaults;
  $("steps").value = d.steps;
  $("steps").max = settings.max_steps;
  $("guidance").value = d.guidance;
  $("seed").value = d.seed;
  for (const name of Object.keys(settings.samplers)) $("sampler").add(new Option(name, name, false, name === d.sampler));
  if (settings.reference) $("picture-row").hidden = false;
  const loadMs = performance.now() - t0;
  $("about").textContent = `${settings.model} (${settings.family}, ${settings.precision}), ${settings.height}x${settings.width}; `
    + `onnxruntime-web ${settings.runtime.version}, ${ep[0]}, ${threads} thread${threads > 1 ? "s" : ""}`
    + `${crossOriginIsolated ? "" : " (not cross-origin isolated)"}; loaded in ${(loadMs / 1000).toFixed(2)} s`;
  document.body.dataset.loadMs = loadMs.toFixed(1);
  document.body.dataset.threads = threads;
  document.body.dataset.ep = ep[0];
  $("generate").disabled = false;
  status("ready");
}

// the picked picture as RGBA pixels of the reference size the page encodes at; a picture of another size is
// resized here by the browser (generate resizes with Lanczos: that picture's edit differs from generate's)
async function picture(notices) {
  const ref = pipeline.settings.reference, file = $("picture").files[0];
  if (!ref || !file) return null;
  const bitmap = await createImageBitmap(file, { colorSpaceConversion: "none", premultiplyAlpha: "none" });
  if (bitmap.width !== ref.width || bitmap.height !== ref.height)
    notices.push(`the picture (${bitmap.width}x${bitmap.height}) was resized to ${ref.width}x${ref.height} by the browser`);
  const canvas = document.createElement("canvas");
  canvas.width = ref.width;
  canvas.height = ref.height;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.drawImage(bitmap, 0, 0, ref.width, ref.height);
  return { data: ctx.getImageData(0, 0, ref.width, ref.height).data, width: ref.width, height: ref.height };
}

async function generate() {
  if (busy || !pipeline) return;
  busy = true;
  $("generate").disabled = true;
  $("notice").textContent = "";
  $("progress").value = 0;
  const started = performance.now();
  const tick = setInterval(() => { $("timing").textContent = `${((performance.now() - started) / 1000).toFixed(1)} s`; }, 100);
  try {
    const resized = [];
    const r = await pipeline.generate({
      prompt: $("prompt").value, negative: $("negative").value, seed: $("seed").value, steps: $("steps").value,
      guidance: $("guidance").value, sampler: $("sampler").value, image: await picture(resized),
    }, status, (i, n) => { $("progress").value = (i + 1) / n; });
    $("notice").textContent = [...resized, ...r.notices].join("; ");
    let img = $("result");
    if (!img) {
      img = document.createElement("img");
      img.id = "result";
      img.alt = "generated image";
      $("output").append(img);
    }
    img.src = toDataURL(r.image, r.width, r.height);
    const t = r.timings;
    $("progress").value = 1;
    $("timing").textContent = `${r.model_evaluations} steps in ${(t.sampling_ms / 1000).toFixed(2)} s `
      + `(${t.per_step_ms.toFixed(1)} ms/step median), text encoder ${t.encode_ms.toFixed(0)} ms, VAE ${t.decode_ms.toFixed(0)} ms, `
      + `total ${(t.total_ms / 1000).toFixed(2)} s`;
    Object.assign(document.body.dataset, { runMs: t.run_ms.toFixed(1), totalMs: t.total_ms.toFixed(1), steps: r.model_evaluations,
      stepMs: t.per_step_ms.toFixed(2), stepTimes: JSON.stringify(t.step_ms.map((x) => +x.toFixed(2))),
      encodeMs: t.encode_ms.toFixed(1), decodeMs: t.decode_ms.toFixed(1) });
    status("done");
  } catch (e) {
    $("progress").value = 0;
    status(e instanceof InputError ? e.message : String(e && e.message || e), true);
  } finally {
    clearInterval(tick);
    busy = false;
    $("generate").disabled = false;
  }
}

$("generate").addEventListener("click", generate);
start().catch((e) => status(String(e && e.message || e), true));
