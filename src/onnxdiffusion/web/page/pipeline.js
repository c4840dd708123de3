// The page's pipeline: prompt -> token ids (prompt.js), seed -> the latents and noise numpy draws (rng.js),
// settings -> the sampler table rows export-web computed with the Python pipeline, then the whole-pipeline
// graph in its three parts (web/parts.py): the prologue (text encoder(s)) once, the step graph once per table
// row (this file's loop: progress and time per step), the epilogue (VAE decoder) once: uint8 image out.
// Runs in the browser and in node (tests): every file is read through `load(path) -> ArrayBuffer`.

import { NumpyRandom } from "./rng.js";
import { PromptEncoder } from "./prompt.js";

export const MAX_SEED = (1n << 63n) - 1n;

export class InputError extends Error {}

const decoder = new TextDecoder();
const json = (buf) => JSON.parse(decoder.decode(buf));

export class WebPipeline {
  // ort: the onnxruntime-web module; Tokenizer: @huggingface/tokenizers' class; load(path): the folder's bytes
  static async load({ ort, Tokenizer, load, sessionOptions = {}, onStatus = () => {} }) {
    const p = new WebPipeline();
    p.ort = ort;
    onStatus("loading settings");
    p.settings = json(await load("settings.json"));
    p.tables = new Float32Array(await load(p.settings.tables.file));
    p.encoders = [];
    for (const t of p.settings.text_inputs) {
      const [tj, cj] = await Promise.all([load(t.tokenizer), load(t.config)]);
      p.encoders.push({ spec: t, enc: new PromptEncoder(Tokenizer, json(tj), json(cj), t) });
    }
    const g = p.settings.graph;
    onStatus(`loading the graph (${(g.bytes / 1e6).toFixed(1)} MB in ${Object.keys(g.parts).length} parts)`);
    const bytes = {};
    for (const [name, part] of Object.entries(g.parts)) bytes[name] = new Uint8Array(await load(part.file));
    if (p.settings.reference) bytes.reference = new Uint8Array(await load(p.settings.reference.file));
    onStatus("creating the sessions");
    p.sessions = {};
    try {
      for (const [name, b] of Object.entries(bytes))
        p.sessions[name] = await ort.InferenceSession.create(b, { executionProviders: ["wasm"], ...sessionOptions });
    } catch (e) {
      throw new Error(`this browser cannot run the graph: ${String(e && e.message || e).split("\n")[0]}`);
    }
    return p;
  }

  // the user's settings checked and completed from the folder's defaults; throws InputError
  resolve({ prompt, negative = "", seed, steps, guidance, sampler, image = null }) {
    const s = this.settings, d = s.defaults;
    if (typeof prompt !== "string" || prompt.trim() === "") throw new InputError("empty prompt");
    const ref = s.reference;
    if (ref && !image) throw new InputError("this model edits a picture: pick the picture to edit");
    if (!ref && image) throw new InputError("this model draws from the prompt alone: it takes no picture");
    if (ref && (image.width !== ref.width || image.height !== ref.height
                || ![3, 4].includes(image.data.length / (ref.width * ref.height))))
      throw new InputError(`the picture must be ${ref.width}x${ref.height} RGB or RGBA pixels, got ${image.width}x${image.height}`);
    const seedText = String(seed ?? d.seed).trim();
    if (!/^\d+$/.test(seedText) || BigInt(seedText) > MAX_SEED)
      throw new InputError(`seed must be an integer in [0, 2**63-1], got ${JSON.stringify(seedText)}`);
    const stepsText = String(steps ?? d.steps).trim();
    const nSteps = /^\d+$/.test(stepsText) ? Number(stepsText) : NaN;
    if (!(nSteps >= 1 && nSteps <= s.max_steps))
      throw new InputError(`steps must be an integer in [1, ${s.max_steps}], got ${JSON.stringify(stepsText)}`);
    const g = guidance === undefined || guidance === "" ? d.guidance : Number(guidance);
    if (!Number.isFinite(g) || g < 0 || g > 100) throw new InputError(`guidance must be in [0, 100], got ${guidance}`);
    const name = sampler || d.sampler;
    if (!(name in s.samplers)) throw new InputError(`unknown sampler ${JSON.stringify(name)}; choose from ${Object.keys(s.samplers).join(", ")}`);
    return { prompt, negative: negative || "", seed: BigInt(seedText), steps: nSteps, guidance: g, sampler: name, image };
  }

  // -> {image: Uint8Array (H*W*3), width, height, notices, timings}; throws InputError on bad input.
  // onStep(i, n, ms): after step i (0-based) of n, that step's time
  async generate(request, onStatus = () => {}, onStep = () => {}) {
    const r = this.resolve(request);
    const s = this.settings, ort = this.ort;
    const t0 = performance.now();
    const notices = [];
    const feeds = {};
    for (const { spec, enc } of this.encoders) {
      const cond = enc.encode(r.prompt), uncond = enc.encode(r.negative);
      if (cond.dropped !== null && !notices.some((n) => n.startsWith("prompt")))
        notices.push(`prompt truncated to ${spec.max_length} tokens; dropped: ${JSON.stringify(cond.dropped)}`);
      if (uncond.dropped !== null && !notices.some((n) => n.startsWith("negative")))
        notices.push(`negative prompt truncated to ${spec.max_length} tokens; dropped: ${JSON.stringify(uncond.dropped)}`);
      const dtype = spec.dtype || "int32";
      feeds[spec.input] = new ort.Tensor(dtype, cond.ids, [1, cond.ids.length]);
      if (s.guided) feeds[spec.uncond_input] = new ort.Tensor(dtype, uncond.ids, [1, uncond.ids.length]);
      if (spec.mask_input) {  // an LLM encoder: its attention masks beside the ids
        feeds[spec.mask_input] = new ort.Tensor(dtype, cond.mask, [1, cond.mask.length]);
        if (s.guided) feeds[spec.uncond_mask_input] = new ort.Tensor(dtype, uncond.mask, [1, uncond.mask.length]);
      }
    }
    const t = s.samplers[r.sampler].tables[String(r.steps)];
    const shape = s.latent_shape;
    const count = shape.reduce((a, b) => a * b, 1);
    // the draws `generate` makes: latents first, then per-step noise for an ancestral sampler
    const rng = new NumpyRandom(r.seed);
    const latents = rng.standardNormal(count);
    const noise = t.needs_noise ? rng.standardNormal(t.rows * count) : new Float32Array(count);
    const width = s.table_width;
    feeds.latents = new ort.Tensor("float32", latents, shape);
    feeds.table = new ort.Tensor("float32", this.tables.slice(t.offset, t.offset + t.rows * width), [t.rows, width]);
    feeds.init_scale = new ort.Tensor("float32", new Float32Array([t.init_scale]), []);
    // the host loop skips guidance at scale <= 1 (cond only); u + 1*(c - u) is that
    // the family's CFG scale of the guidance (a * g + b; Z-Image's is g + 1), or the backbone's own guidance input
    const [ga, gb] = s.guidance_scale || [1, 0];
    feeds.guidance = new ort.Tensor("float32", new Float32Array([Math.max(ga * r.guidance + gb, 1)]), []);
    if (s.guidance_input) feeds[s.guidance_input] = new ort.Tensor("float32", new Float32Array([r.guidance]), [1]);
    feeds.noise = new ort.Tensor("float32", noise, [t.needs_noise ? t.rows : 1, ...shape]);
    feeds.steps = new ort.Tensor("int64", new BigInt64Array([BigInt(t.rows)]), []);
    if (s.reference) {  // the picture to edit -> its reference latents (web/reference.py), fed to every step
      onStatus("encoding the picture");
      const ref = s.reference, n = ref.width * ref.height, px = r.image.data, k = px.length / n;
      const rgb = new Uint8Array(3 * n);
      for (let i = 0; i < n; i++) for (let c = 0; c < 3; c++) rgb[3 * i + c] = px[k * i + c];
      const out = await this.sessions.reference.run({ [ref.input]: new ort.Tensor("uint8", rgb, [1, ref.height, ref.width, 3]) });
      for (const name of ref.feeds) feeds[name] = out[ref.output];
    }
    const t1 = performance.now();
    const { parts, wiring } = s.graph;
    // fresh copies: a run in the proxy worker (app.js's default) takes its inputs' buffers away
    const copy = (x) => new ort.Tensor(x.type, x.data.slice(), x.dims);
    const pick = (names, values) => Object.fromEntries(names.filter((k) => k in values).map((k) => [k, copy(values[k])]));
    onStatus("encoding the prompt");
    const values = { ...feeds, ...await this.sessions.prologue.run(pick(parts.prologue.inputs, feeds)) };
    const t2 = performance.now();
    const [xIn, dIn] = Object.keys(wiring.carry);
    let carried = { [xIn]: values[wiring.start[xIn]], [dIn]: values[wiring.start[dIn]] };
    const fixed = pick(parts.step.inputs.filter((k) => k !== "iter" && !(k in carried)), values);
    const stepMs = [];
    for (let i = 0; i < t.rows; i++) {
      onStatus(`sampling: step ${i + 1}/${t.rows}`);
      const ts = performance.now();
      const out = await this.sessions.step.run({ ...pick(Object.keys(fixed), fixed), ...carried,
        iter: new ort.Tensor("int64", new BigInt64Array([BigInt(i)]), []) });
      carried = { [xIn]: out[wiring.carry[xIn]], [dIn]: out[wiring.carry[dIn]] };
      stepMs.push(performance.now() - ts);
      onStep(i, t.rows, stepMs[i]);
    }
    const t3 = performance.now();
    onStatus("decoding the image");
    values[wiring.final] = carried[xIn];
    const out = await this.sessions.epilogue.run(pick(parts.epilogue.inputs, values));
    const t4 = performance.now();
    const img = out.image;
    const [, height, w] = img.dims;
    const sorted = [...stepMs].sort((a, b) => a - b);
    const median = sorted.length % 2 ? sorted[(sorted.length - 1) / 2] : (sorted[sorted.length / 2 - 1] + sorted[sorted.length / 2]) / 2;
    return {
      image: img.data, width: w, height, notices, settings: r, model_evaluations: t.rows,
      timings: { prepare_ms: t1 - t0, encode_ms: t2 - t1, sampling_ms: t3 - t2, decode_ms: t4 - t3, run_ms: t4 - t1,
                 step_ms: stepMs, per_step_ms: median, total_ms: t4 - t0 },
    };
  }
}
