"""`export-web MODEL OUT`: a static page folder that runs MODEL's whole pipeline in the browser.

OUT holds index.html and its modules (page/), onnxruntime-web and @huggingface/tokenizers (the pinned npm
packages), the whole-pipeline graph in its portable form (token ids in, uint8 image out) cut in three so the
page steps the sampling loop itself (parts.py: prologue, step, epilogue), the tokenizer files, and
settings.json + tables.bin (sampler tables for every step count, defaults). It is written under a
temporary name and renamed, so OUT is either the old folder or the complete new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from .. import interrupts
from ..folder.artifacts import check_output_folder, confined, read_manifest
from ..folder.manifest import Component
from ..errors import UserError
from ..onnxio.files import write
from .npm import ensure_installed, pinned
from .parts import PARTS, split_whole_graph
from .settings import guidance_scale, sampler_tables, size_feeds, text_inputs

PAGE = Path(__file__).resolve().parent / "page"
PAGE_FILES = ("index.html", "app.js", "pipeline.js", "prompt.js", "rng.js")
KIND = "onnxdiffusion-web"
# onnxruntime-web's files the page loads: the WASM build (SIMD; threads when cross-origin isolated), and
# the WebGPU build (its own WASM, with the WebGPU and WASM providers) when asked for
WASM_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")
WEBGPU_FILES = ("ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
PART_FILES = {part: f"model/{part}.onnx" for part in PARTS}
REFERENCE_FILE = "model/reference.onnx"
PAGE_FEEDS = ("latents", "table", "init_scale", "guidance", "noise", "steps")  # what pipeline.js feeds besides ids
TEXT_FEEDS = ("input", "uncond_input", "mask_input", "uncond_mask_input")  # a text entry's inputs pipeline.js feeds


def _is_page_folder(path: Path) -> bool:
    try:
        return json.loads((path / "settings.json").read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def _check_out(out: Path, model: Path, overwrite: bool) -> None:
    """artifacts' output checks; --overwrite replaces a page folder (settings.json of kind onnxdiffusion-web)."""
    page = overwrite and out.is_dir() and not out.is_symlink() and _is_page_folder(out)
    if not page:
        if overwrite and out.is_dir() and any(out.iterdir()):
            raise UserError(f"--overwrite replaces only a page folder written by export-web; {out} is not one")
        check_output_folder(out, overwrite, inputs=(model,))
        return
    s, m = out.resolve(), model.resolve()
    if s == m or s in m.parents or m in s.parents:
        raise UserError(f"output {out} overlaps the input {model} (OUT must not be, contain or be inside it)")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory is not writable: {out.parent}")


def whole_graph(model: Path, scratch: Path) -> tuple[onnx.ModelProto, Component]:
    """MODEL's whole-pipeline graph, portable (ORT_ENABLE_EXTENDED at most, no CPU-tuned layouts): compiled
    into a scratch copy of the folder; returns the graph and its manifest entry."""
    from ..loopgraph.compile import compile_loop

    entry = compile_loop(model, scratch / "model", form="loop", whole=True, cpu_tuned=False)
    if entry.tuned_for:
        raise UserError(f"{model}: the whole graph came out tuned to this CPU; the page needs the portable form")
    if entry.external_data:
        raise UserError(f"{model}: the whole graph is over 2 GB ({entry.bytes / 1e9:.1f} GB); the page takes one "
                        f"file under 2 GB")
    return onnx.load(str(confined(scratch / "model", entry.path, "sampling graph"))), entry


def export_web(model: Path | str, out: Path | str, max_steps: int = 50, samplers: list[str] | None = None,
               webgpu: bool = True, overwrite: bool = False, allow_drift: bool = False, log=lambda s: None) -> dict:
    """Write the page folder `out` for the model folder `model`; returns its settings. An int8-static folder
    quantized with rounding=cpu (the recipe's default) is refused unless `allow_drift`: its page's images would
    not be generate's (see _check_rounding)."""
    from ..runtime import Pipeline
    from ..runtime.generation import GenerateOptions

    model, out = Path(model), Path(out)
    if not isinstance(max_steps, int) or not 1 <= max_steps <= 1000:
        raise UserError(f"--max-steps must be in [1, 1000], got {max_steps}")
    _check_out(out, model, overwrite)
    manifest = read_manifest(model)
    t0 = time.time()
    pipe = Pipeline.from_folder(model)  # the tables, shapes and tokenizers `generate` uses (checks the folder)
    if pipe.family.whole_refusal:  # the page runs the whole graph: a family without one says why, in one line
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: {pipe.family.whole_refusal}")
    if pipe.family.zero_negative(pipe.info):  # (the size conditioning no longer stops SDXL: say what does)
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: without a negative prompt their "
                        "unconditional embeddings are zeros (force_zeros_for_empty_prompt), not the whole graph's "
                        "encoding of \"\"")
    defaults = pipe.resolve(GenerateOptions())
    recipe = manifest.quantization_recipe
    _check_rounding(model, recipe, allow_drift, log)
    if defaults.steps > max_steps:
        raise UserError(f"the model's recommended {defaults.steps} steps exceed --max-steps {max_steps}")
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-web-") as scratch:
        log(f"compiling the whole-pipeline graph of {model} (portable form)")
        graph, entry = whole_graph(model, Path(scratch))
        h, w = pipe.image_size(defaults)
        _bake(graph, size_feeds(pipe, h, w))
        reference = _reference_part(pipe, model, graph, h, w)
        parts, wiring = split_whole_graph(graph)
        # inputs with a default (an initializer of the same name: img2img's start row and image inputs) need no feed
        types = {i.name: i.type.tensor_type.elem_type for i in graph.graph.input}
        inputs = set(types) - {t.name for t in graph.graph.initializer}
        tables, rows = sampler_tables(pipe, max_steps, samplers)
        if defaults.sampler not in tables:
            raise UserError(f"the model's default sampler {defaults.sampler!r} is not among {', '.join(tables)}")
        texts = text_inputs(pipe, {k: types[k] for k in inputs})
        embedded = pipe.family.guidance_input_for(pipe.info)
        guidance_input = f"cond_{embedded}" if embedded and f"cond_{embedded}" in inputs else None
        fed = set(PAGE_FEEDS) | {t.get(k) for t in texts for k in TEXT_FEEDS} | {guidance_input} - {None}
        fed |= set(reference[1]["feeds"]) if reference else set()
        if inputs - fed:  # e.g. a packed-latent family's grid inputs: pipeline.js would not feed them
            raise UserError(f"the page cannot run {pipe.family.name} folders yet: their whole graph also takes "
                            f"{', '.join(sorted(inputs - fed))}")
        settings = {
            "kind": KIND, "format": 1,
            "model": (manifest.source_path or model.name).split("/")[-1] or model.name,
            "family": pipe.family.name,
            "precision": manifest.components[pipe.family.backbone].precision or "fp32",
            "rounding": recipe.get("rounding", "cpu") if recipe.get("name") == "int8-static" else None,
            "height": h, "width": w,
            "latent_shape": list(pipe.latent_shape(defaults)),
            "guided": "uncond_input_ids" in inputs,
            "guidance_scale": guidance_scale(pipe), "guidance_input": guidance_input,
            "defaults": {"steps": defaults.steps, "guidance": defaults.guidance, "sampler": defaults.sampler, "seed": 0},
            "max_steps": max_steps,
            "samplers": tables,
            "table_width": graph_table_width(graph),
            "tables": {"file": "tables.bin", "dtype": "float32", "byte_order": "little", "count": int(rows.size)},
            "text_inputs": texts,
            "reference": reference[1] if reference else None,
            "graph": {"parts": {p: {"file": PART_FILES[p], "bytes": 0, "inputs": wiring["inputs"][p]} for p in PARTS},
                      "bytes": 0, "prefused": entry.setting("prefused"), "inputs": sorted(inputs),
                      "wiring": {k: wiring[k] for k in ("steps_input", "start", "carry", "final")}},
            "runtime": {"package": "onnxruntime-web", "version": pinned()["onnxruntime-web"], "wasm": WASM_FILES[0],
                        "webgpu": WEBGPU_FILES[0] if webgpu else None},
            "tokenizer_package": {"package": "@huggingface/tokenizers", "version": pinned()["@huggingface/tokenizers"]},
        }
        del pipe, graph
        node_modules = ensure_installed(log)  # after every check on MODEL: a bad folder never reaches npm
        with _atomic_page(out) as tmp:
            _write_page(tmp, model, node_modules, parts, rows, settings, webgpu)
            if reference:  # an editing page's picture -> reference latents graph
                write(reference[0], tmp / REFERENCE_FILE)
                settings["reference"]["bytes"] = (tmp / REFERENCE_FILE).stat().st_size
                settings["graph"]["bytes"] += settings["reference"]["bytes"]
                (tmp / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    settings["export_seconds"] = round(time.time() - t0, 2)
    return settings


def _check_rounding(model: Path, recipe: dict, allow_drift: bool, log) -> None:
    """int8-static rounding=cpu: the WASM build rounds its float kernels (norms, GELUs, attention) differently from
    x86 ONNX Runtime and the int8 graph amplifies those ulps over the steps: measured page vs generate 33-53 dB on
    the embedded SD model (one prompt in six under 40 dB), 42-55 dB on the MMDiT (bench/results/web_quality.md);
    rounding=portable computes generate's image (>= 86 dB, mostly identical)."""
    if recipe.get("name") != "int8-static" or recipe.get("rounding", "cpu") == "portable":
        return
    drift = ("its float kernels round as x86 ONNX Runtime's do, the page's WASM build rounds some differently and its "
             "images land 30-55 dB from generate's")
    if not allow_drift:
        raise UserError(f"{model} is int8-static with rounding=cpu: {drift}; quantize it with -O rounding=portable "
                        f"for a page that makes generate's image, or pass --allow-drift")
    log(f"note: {drift} (--allow-drift)")


def _reference_part(pipe, model: Path, graph: onnx.ModelProto, h: int, w: int) -> tuple | None:
    """An editing family's page (a picture conditions every step): (the picture -> reference latents graph, its
    settings entry), its size-fixed reference inputs baked into `graph`; None for a text-to-image page."""
    if pipe.family.image_role != "reference" or pipe.family.references_optional:
        return None  # (a family that may draw without pictures, FLUX.2, runs text-to-image on the page)
    from .reference import PICTURE, check_reference_graph, reference_graph, reference_size, reference_split

    rh, rw = reference_size(pipe, h, w)
    inputs = {i.name for i in graph.graph.input}
    fixed, fed = reference_split(pipe, rh, rw, inputs)
    _bake(graph, fixed)
    part = reference_graph(pipe, model, rh, rw)
    output = check_reference_graph(pipe, part, rh, rw)
    return part, {"file": REFERENCE_FILE, "input": PICTURE, "output": output, "height": rh, "width": rw,
                  "feeds": fed, "bytes": 0}


def _bake(graph: onnx.ModelProto, feeds: dict) -> None:
    """Each of `feeds` that is a graph input becomes a constant of the graph (an initializer of its name and type):
    the page feeds only what a request changes."""
    from onnx import helper, numpy_helper

    for i in list(graph.graph.input):
        if i.name in feeds:
            value = np.asarray(feeds[i.name], helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
            graph.graph.initializer.append(numpy_helper.from_array(value, i.name))
            graph.graph.input.remove(i)


def graph_table_width(graph: onnx.ModelProto) -> int:
    dims = next(i for i in graph.graph.input if i.name == "table").type.tensor_type.shape.dim
    return int(dims[1].dim_value)


def _write_page(tmp: Path, model: Path, node_modules: Path, parts: dict, rows, settings: dict, webgpu: bool) -> None:
    for name in PAGE_FILES:
        shutil.copyfile(PAGE / name, tmp / name)
    (tmp / "ort").mkdir()
    ort_dist = node_modules / "onnxruntime-web" / "dist"
    for name in WASM_FILES + (WEBGPU_FILES if webgpu else ()):
        shutil.copyfile(ort_dist / name, tmp / "ort" / name)
    _notice(node_modules / "onnxruntime-web", tmp / "ort" / "NOTICE.txt")
    (tmp / "lib").mkdir()
    tok_pkg = node_modules / "@huggingface" / "tokenizers"
    shutil.copyfile(tok_pkg / "dist" / "tokenizers.min.mjs", tmp / "lib" / "tokenizers.min.mjs")
    _notice(tok_pkg, tmp / "lib" / "NOTICE.txt")
    for t in settings["text_inputs"]:
        for key in ("tokenizer", "config"):
            dst = tmp / t[key]
            dst.parent.mkdir(parents=True, exist_ok=True)
            src = confined(model, t[key], "tokenizer file")
            if src.is_file():
                shutil.copyfile(src, dst)
            elif key == "config":
                dst.write_text("{}\n")
            else:
                raise UserError(f"tokenizer file missing: {src}")
    (tmp / "model").mkdir()
    for name, part in parts.items():
        entry = settings["graph"]["parts"][name]
        write(part, tmp / entry["file"])
        entry["bytes"] = (tmp / entry["file"]).stat().st_size
    settings["graph"]["bytes"] = sum(e["bytes"] for e in settings["graph"]["parts"].values())
    rows.astype("<f4").tofile(tmp / "tables.bin")
    (tmp / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")


def _notice(package: Path, dst: Path) -> None:
    """What the folder ships from an npm package: its name, version, license (and the license text if it has one)."""
    meta = json.loads((package / "package.json").read_text())
    text = f"{meta['name']} {meta['version']} (npm), license: {meta.get('license', 'see the package')}\n"
    lic = next((p for p in sorted(package.iterdir()) if p.name.upper().startswith("LICENSE")), None)
    dst.write_text(text + ("\n" + lic.read_text() if lic else ""))


class _atomic_page:
    """A temporary sibling folder renamed to `final` when the block succeeds (the old one moved aside first)."""

    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", suffix=".tmp", dir=self.final.parent))
        return self.tmp

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        from ..folder.artifacts import _fix_modes

        _fix_modes(self.tmp)
        try:
            interrupts.check()  # a Ctrl-C that a library caught while the page was built: publish nothing
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if self.final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", suffix=".old", dir=self.final.parent))
            os.replace(self.final, old / "x")
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        return False
