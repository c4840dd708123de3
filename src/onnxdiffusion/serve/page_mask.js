"use strict";
// The input picture (an upload or a history image) and the inpainting mask painted over it.
// The mask canvas has the picture's own pixel size, so the mask sent is the picture's size (the service
// refuses another); painted pixels become transparent in the mask PNG: OpenAI's convention, transparent = edit.
const Picture = {
  blob: null, width: 0, height: 0, label: "",

  async set(blob, label) {
    const url = URL.createObjectURL(blob);
    const img = document.getElementById("picture");
    await new Promise((ok, bad) => { img.onload = ok; img.onerror = () => bad(new Error("not a readable image")); img.src = url; });
    this.blob = blob; this.width = img.naturalWidth; this.height = img.naturalHeight; this.label = label;
    const canvas = document.getElementById("maskcanvas");
    canvas.width = this.width; canvas.height = this.height;  // also clears it
    document.getElementById("pictureview").hidden = false;
    document.getElementById("picturenote").textContent = `${label}: ${this.width}x${this.height}`;
    document.dispatchEvent(new Event("picturechange"));
  },

  clear() {
    this.blob = null; this.width = this.height = 0;
    document.getElementById("image").value = "";
    document.getElementById("paint").checked = false;
    document.getElementById("pictureview").hidden = true;
    document.getElementById("picture").removeAttribute("src");
    document.dispatchEvent(new Event("picturechange"));
  },

  clearMask() {
    const c = document.getElementById("maskcanvas");
    c.getContext("2d").clearRect(0, 0, c.width, c.height);
  },

  // painted pixels (alpha >= 128 on the canvas: antialiased stroke edges below half count as unpainted)
  paintedMap() {
    const c = document.getElementById("maskcanvas");
    if (!this.blob || !c.width) return null;
    const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    const out = new Uint8Array(c.width * c.height);
    let n = 0;
    for (let i = 0; i < out.length; i++) if (data[4 * i + 3] >= 128) { out[i] = 1; n++; }
    return n ? out : null;
  },

  // the mask PNG (RGBA, transparent where painted), or null when nothing is painted
  async maskBlob() {
    const painted = this.paintedMap();
    if (!painted) return null;
    const c = document.createElement("canvas");
    c.width = this.width; c.height = this.height;
    const ctx = c.getContext("2d");
    const img = ctx.createImageData(c.width, c.height);
    for (let i = 0; i < painted.length; i++) {
      img.data[4 * i] = img.data[4 * i + 1] = img.data[4 * i + 2] = 0;
      img.data[4 * i + 3] = painted[i] ? 0 : 255;
    }
    ctx.putImageData(img, 0, 0);
    return await new Promise((ok) => c.toBlob(ok, "image/png"));
  },
};

(function brush() {
  const canvas = document.getElementById("maskcanvas");
  let last = null;
  const at = (ev) => {  // pointer position in the picture's pixels (the canvas is shown scaled)
    const r = canvas.getBoundingClientRect();
    return [(ev.clientX - r.left) * canvas.width / r.width, (ev.clientY - r.top) * canvas.height / r.height];
  };
  const radius = () => Number(document.getElementById("brush").value) * canvas.width / 192 / 2;
  const dot = (p, q) => {
    const ctx = canvas.getContext("2d");
    ctx.strokeStyle = ctx.fillStyle = "rgb(230, 40, 90)";
    ctx.lineWidth = 2 * radius(); ctx.lineCap = "round";
    ctx.beginPath(); ctx.moveTo(...(q || p)); ctx.lineTo(...p); ctx.stroke();
  };
  canvas.addEventListener("pointerdown", (ev) => {
    if (!document.getElementById("paint").checked) return;
    canvas.setPointerCapture(ev.pointerId);
    last = at(ev); dot(last);
    ev.preventDefault();
  });
  canvas.addEventListener("pointermove", (ev) => {
    if (!last) return;
    const p = at(ev); dot(p, last); last = p;
  });
  const up = () => { if (last) document.dispatchEvent(new Event("maskchange")); last = null; };
  canvas.addEventListener("pointerup", up);
  canvas.addEventListener("pointercancel", up);
})();
