"use strict";
const $ = (id) => document.getElementById(id);

// The key lives in sessionStorage (this tab only) and goes in an Authorization header on every API
// call; EventSource and <img src> cannot send headers, so events and images are read with fetch().
const key = () => sessionStorage.getItem("onnxdiffusion-api-key") || "";
function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (key()) headers["Authorization"] = "Bearer " + key();
  return fetch(path, Object.assign({}, options, { headers }));
}
let MODELS = [];
let CURRENT = null;  // the id of the job the viewer follows
const HISTORY_KEY = "onnxdiffusion-history", HISTORY_MAX = 24;
const say = (text) => { $("message").textContent = text || ""; };
const model = () => MODELS.find((m) => m.id === $("model").value);

// -- the model's choices -------------------------------------------------------------------------
function fillModel(keep) {
  const m = model();
  if (!m) return;
  const choose = (select, values, value, label = (v) => v) => {
    select.innerHTML = "";
    for (const v of values) select.add(new Option(label(v), v));
    if (values.includes(value)) select.value = value;
  };
  choose($("size"), m.buckets, keep ? keep.size : m.buckets[0]);
  choose($("sampler"), m.samplers.map((s) => s.name), keep && keep.sampler ? keep.sampler : m.defaults.sampler,
         (v) => v + (v === m.defaults.sampler ? " (model default)" : ""));
  if (!keep) { $("steps").value = m.defaults.steps; $("guidance").value = m.defaults.guidance; }
  $("lorabox").hidden = !m.loras.length;
  $("loras").innerHTML = "";
  for (const name of m.loras) {
    const row = document.createElement("div");
    row.className = "lora";
    row.innerHTML = `<label class="inline"><input type="checkbox" class="lora-on"> <span></span></label>
      <input type="number" class="lora-scale" step="0.05" value="1" title="weight">`;
    row.dataset.name = name;
    row.querySelector("span").textContent = name;
    row.querySelector("input.lora-on").id = "lora-" + name;
    const scale = row.querySelector(".lora-scale");
    [scale.min, scale.max] = m.lora_scale;
    scale.id = "lora-w-" + name;
    $("loras").append(row);
  }
  $("controlbox").hidden = !m.controlnets.length;
  choose($("controlnet"), ["", ...m.controlnets], "", (v) => v || "none");
  $("picturebox").hidden = !m.takes_picture;
  pictureChanged();
}

// samplers that cannot start from a picture are greyed out while one is set
function pictureChanged() {
  const m = model();
  if (!m) return;
  for (const opt of $("sampler").options) {
    const s = m.samplers.find((x) => x.name === opt.value);
    opt.disabled = Boolean(Picture.blob) && s && !s.from_picture;
  }
  if (m.needs_mask) $("picturenote").textContent = "this is an inpainting model: paint the area to repaint";
}
document.addEventListener("picturechange", pictureChanged);

async function init() {
  $("apikey").value = key();
  const r = await api("/v1/page/models");
  if (r.status === 401) { $("ready").textContent = "this server needs an API key: " + (await r.json()).error.message; return; }
  if (!r.ok) { $("ready").textContent = "cannot list models: " + r.status; return; }
  const body = await r.json();
  MODELS = body.data;
  $("steps").max = body.max_steps;
  $("model").innerHTML = "";
  for (const m of MODELS) {
    const label = m.id + " (" + m.precision + (m.status === "degraded" ? ", degraded: served by " + m.fallback_to : "") + ")";
    $("model").add(new Option(label, m.id));
  }
  if (body.default_model && MODELS.some((m) => m.id === body.default_model)) $("model").value = body.default_model;
  fillModel(null);
  const ready = await fetch("/ready");
  const state = await ready.json();
  const failed = Object.entries(state.failed || {}).map(([id, e]) => id + ": " + e).join("; ");
  $("ready").textContent = (ready.ok ? "ready" : "models still loading") + (failed ? " (unavailable: " + failed + ")" : "");
  if (!ready.ok && !state.error) setTimeout(init, 2000);
}
$("model").onchange = () => fillModel(null);
$("keyform").onsubmit = (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("onnxdiffusion-api-key", $("apikey").value.trim());
  init();
};
// Ctrl+Enter (or Cmd+Enter) in a prompt generates, as in most chat and image tools
for (const id of ["prompt", "negative"])
  $(id).addEventListener("keydown", (ev) => { if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) $("submit").click(); });
$("randomseed").onclick = () => { $("seed").value = ""; };
$("image").onchange = async () => {
  const file = $("image").files[0];
  if (file) await Picture.set(file, file.name).catch((e) => say(file.name + ": " + e.message));
};
$("clearpicture").onclick = () => Picture.clear();
$("clearmask").onclick = () => Picture.clearMask();

// -- one request ---------------------------------------------------------------------------------
// The form as the page reuses it (history's "reuse"); the seed is the one the server used, filled in later.
function formValues() {
  const loras = [...document.querySelectorAll("#loras .lora")]
    .filter((row) => row.querySelector(".lora-on").checked)
    .map((row) => ({ name: row.dataset.name, scale: Number(row.querySelector(".lora-scale").value) }));
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return { prompt: $("prompt").value, negative_prompt: $("negative").value, model: $("model").value,
           size: $("size").value, steps: num("steps"), guidance: num("guidance"), sampler: $("sampler").value,
           seed: num("seed"), loras, strength: num("strength"), controlnet: $("controlnet").value,
           cscale: num("cscale") };
}

function fillForm(f) {
  if (MODELS.some((m) => m.id === f.model)) { $("model").value = f.model; fillModel(f); }
  for (const [id, name] of [["prompt", "prompt"], ["negative", "negative_prompt"], ["steps", "steps"],
                            ["guidance", "guidance"], ["seed", "seed"], ["strength", "strength"], ["cscale", "cscale"]])
    $(id).value = f[name] === null || f[name] === undefined ? "" : f[name];
  for (const row of document.querySelectorAll("#loras .lora")) {
    const hit = (f.loras || []).find((l) => l.name === row.dataset.name);
    row.querySelector(".lora-on").checked = Boolean(hit);
    if (hit) row.querySelector(".lora-scale").value = hit.scale;
  }
  if ([...$("controlnet").options].some((o) => o.value === f.controlnet)) $("controlnet").value = f.controlnet || "";
}

// JSON job, or a multipart picture/ControlNet job (POST /v1/jobs/edits: same checks as /v1/images/edits)
async function submitJob(f) {
  const control = $("control").files[0];
  const useNet = f.controlnet && control;
  if (f.controlnet && !control) throw new Error("choose a control picture for ControlNet " + f.controlnet);
  if (!Picture.blob && !useNet) {
    const body = { prompt: f.prompt, negative_prompt: f.negative_prompt, model: f.model, size: f.size, steps: f.steps,
                   guidance: f.guidance, sampler: f.sampler, preview: true };
    if (f.seed !== null) body.seed = f.seed;
    if (f.loras.length) body.lora = f.loras;
    return api("/v1/jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  }
  const form = new FormData();
  for (const name of ["prompt", "negative_prompt", "model", "size", "steps", "guidance", "sampler", "seed"])
    if (f[name] !== null && f[name] !== "") form.append(name, f[name]);
  if (f.loras.length) form.append("lora", JSON.stringify(f.loras));
  if (Picture.blob) {
    form.append("image", Picture.blob, "picture.png");
    if (f.strength !== null) form.append("strength", f.strength);
    const mask = await Picture.maskBlob();
    if (mask) {
      form.append("mask", mask, "mask.png");
      window.__lastMask = await blobURL(mask);  // what was sent, for a test to send the API the same
    }
  }
  if (useNet) {
    form.append("controlnet", f.controlnet + ":" + (f.cscale === null ? 1 : f.cscale));
    form.append("control", control, control.name);
  }
  return api("/v1/jobs/edits", { method: "POST", body: form });
}

const blobURL = (blob) => new Promise((ok) => { const r = new FileReader(); r.onload = () => ok(r.result); r.readAsDataURL(blob); });

$("form").onsubmit = async (ev) => {
  ev.preventDefault();
  say("");
  if (!Picture.blob && $("image").files.length) await Picture.set($("image").files[0], $("image").files[0].name);
  const f = formValues();
  let r;
  try { r = await submitJob(f); } catch (e) { say(e.message); return; }
  const s = await r.json();
  if (!r.ok) { say(s.error.message); return; }
  const card = jobCard(s.id, f);
  if (s.notices) card.dataset.edit = s.notices.join("; ");
  else if (Picture.blob) card.dataset.edit = "edited";
  follow(s.id);
  show(card, s);
  await events("/v1/jobs/" + s.id + "/events", async (name, data) => {
    if (name === "error") { card.querySelector(".status").textContent = data.error.message; return; }
    show(card, data);
    if (name !== "done") return;
    card.querySelector(".cancel").disabled = true;
    if (CURRENT === s.id) $("cancel").disabled = true;
    if (data.status !== "succeeded") return;
    const png = await api(data.images[0]);
    const url = await blobURL(await png.blob());
    const img = card.querySelector(".preview");
    img.src = url;
    img.className = "result";
    if (CURRENT === s.id) $("current").src = url;
    f.seed = data.settings.seed;  // reuse makes the same image
    remember({ id: s.id, form: f, settings: data.settings, image: url });
  });
};

// -- progress ------------------------------------------------------------------------------------
// Server-sent events over fetch (so the key can travel in a header): calls on(event, data) per event.
async function events(path, on) {
  const r = await api(path);
  if (!r.ok) { on("error", await r.json()); return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      await on(name, JSON.parse(data));
    }
  }
}

function follow(id) {
  CURRENT = id;
  $("cancel").disabled = false;
  $("current").removeAttribute("src");
  $("progress").value = 0;
  document.body.dataset.current = id;
}
$("cancel").onclick = () => CURRENT && cancel(CURRENT);

async function cancel(id) {
  const r = await api("/v1/jobs/" + id, { method: "DELETE" });
  if (!r.ok) say((await r.json()).error.message);
}

function describe(st) {
  const parts = [st.model + (st.fallback ? " (for " + st.model_requested + ")" : ""), st.bucket, st.sampler,
                 st.steps + " steps", "cfg " + st.guidance, "seed " + st.seed];
  if (st.edit === "reference") parts.push("edited by instruction");  // an editing model: no strength
  else if (st.strength !== undefined && st.image_size) parts.push("strength " + st.strength + (st.mask ? ", masked" : ""));
  if (st.lora) parts.push("lora " + st.lora.map((l) => l.name + ":" + l.scale).join(","));
  if (st.controlnet) parts.push("controlnet " + st.controlnet.name);
  return parts.join(" · ");
}

function jobCard(id, f, done) {
  const card = document.createElement("div");
  card.className = "job";
  card.id = "job-" + id;
  card.innerHTML = `<img class="preview" alt="" title="show">
    <div><code>${id.slice(0, 8)}</code> <span class="status">queued</span></div>
    <progress class="bar" max="1" value="0"></progress> <span class="steps"></span>
    <div class="prompt"></div><div class="settings"></div>
    <div class="buttons"><button class="cancel" type="button">Cancel</button>
    <button class="reuse" type="button" title="fill the form with these settings">Reuse</button>
    <button class="use-input" type="button" title="start the next image from this one">Use as input</button></div>`;
  card.querySelector(".prompt").textContent = f.prompt;
  card.querySelector(".prompt").title = f.prompt;
  card.querySelector(".cancel").onclick = () => cancel(id);
  card.querySelector(".reuse").onclick = () => { fillForm(card.form); say("settings of " + id.slice(0, 8) + " loaded"); };
  card.querySelector(".use-input").onclick = async () => {
    const src = card.querySelector("img.result");
    if (!src) return say("this job has no image");
    await Picture.set(await (await fetch(src.src)).blob(), "from " + id.slice(0, 8));
  };
  card.querySelector("img").onclick = (ev) => { if (ev.target.src) $("current").src = ev.target.src; };
  card.form = f;
  if (done) card.querySelector(".cancel").disabled = true;
  $("jobs").prepend(card);
  return card;
}

function show(card, s) {
  const status = card.querySelector(".status");
  status.textContent = s.status + (s.queue_position !== null && s.queue_position !== undefined ? " (position " + s.queue_position + ")" : "");
  status.className = "status status-" + s.status;
  card.querySelector(".bar").value = s.progress;
  card.querySelector(".steps").textContent = "step " + s.step + "/" + s.steps;
  card.querySelector(".settings").textContent = describe(s.settings);
  card.dataset.seed = s.settings.seed;
  if (s.preview && s.status !== "succeeded") card.querySelector(".preview").src = "data:image/png;base64," + s.preview;
  card.dataset.events = String(Number(card.dataset.events || 0) + 1);
  card.dataset.status = s.status;
  if (card.id !== "job-" + CURRENT) return;
  $("progress").value = s.progress;
  const m = MODELS.find((x) => x.id === s.settings.model);
  const how = s.status === "running" && s.preview && m ? " · preview: " + m.preview_decoder + " decoder" : "";
  $("info").textContent = s.status + " · step " + s.step + "/" + s.steps + how + " · " + describe(s.settings);
  if (s.preview && s.status !== "succeeded") $("current").src = "data:image/png;base64," + s.preview;
}

// -- history (this browser's localStorage: the newest HISTORY_MAX results) ------------------------
function history() {
  try { return JSON.parse(localStorage.getItem(HISTORY_KEY) || "[]"); } catch { return []; }
}
function remember(entry) {
  const items = [entry, ...history().filter((e) => e.id !== entry.id)].slice(0, HISTORY_MAX);
  while (items.length) {  // a full quota drops the oldest results
    try { localStorage.setItem(HISTORY_KEY, JSON.stringify(items)); return; } catch { items.pop(); }
  }
}
function restoreHistory() {
  for (const e of history().slice().reverse()) {
    const card = jobCard(e.id, e.form, true);
    show(card, { status: "succeeded", progress: 1, step: e.settings.steps, steps: e.settings.steps, settings: e.settings });
    const img = card.querySelector(".preview");
    img.src = e.image;
    img.className = "result";
    card.dataset.restored = "1";
  }
}
$("clearhistory").onclick = () => { localStorage.removeItem(HISTORY_KEY); $("jobs").innerHTML = ""; };

restoreHistory();
init();
