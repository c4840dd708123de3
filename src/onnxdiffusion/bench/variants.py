"""What the bench can run: variants as data, discovered from model folders, never from quantize internals.

A variant is one way to turn a prompt into an image:

  torch-fp32              diffusers' PyTorch pipeline on the model's diffusers source folder (DDIM)
  torch-bf16              the same in bfloat16 (asked for by name: the eager peer on CPUs with avx512_bf16 / AMX)
  ort-fp32                our ONNX Runtime pipeline, numpy host loop (DDIM, --steps)
  ort-fp32-loop           the same with the sampling loop as one ONNX Loop graph (manifest `sampler_loop`)
  ort-fp32-unrolled       ... as one unrolled graph (manifest `sampler_unrolled`, fixed step count)
  ort-fp32-dpmpp          DPM-Solver++ 2M at fewer steps (--fast-steps)
  ort-<recipe>[-loop|-unrolled|-dpmpp]
                          a quantized model folder: same layout as an export, `quantization` in its
                          manifest (built by --quantize RECIPE, else found among --variants-dir's sub-folders,
                          default MODEL's siblings)
  optimum-ort             Hugging Face Optimum's ORTStableDiffusionPipeline on our folder (.venv-optimum)
  openvino-fp32, openvino-int8-hybrid
                          optimum-intel's OVStableDiffusionPipeline on the diffusers source (.venv-openvino)
  sdcpp-fp32, sdcpp-q8_0, sdcpp-q4_0, sdcpp-q4_K
                          stable-diffusion.cpp on the diffusers source converted to GGUF (.venv-sdcpp);
                          SD1.x-shaped models (--arch sd15: fp32, q8_0, q4_0) and Z-Image / FLUX.2 [klein]
                          (--arch zimage, flux2_klein: q8_0, q4_K)

A variant that cannot run here is kept with a `skip` reason (shown in the report), never dropped silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..folder.artifacts import MANIFEST, confined, read_manifest, verify_folder
from ..errors import UserError
from ..families.sd import StableDiffusion
from ..folder.manifest import Manifest
from ..folder.paths import embedded_diffusers_folder, models_root, shown_path
from .alike import SDCPP_SAMPLERS, TINY_VAE_DIR, peer_sampler, peer_sampler_skip, tiny_skip  # noqa: F401 (re-exported)
from .arch.sdcpp_files import layout as sdcpp_layout

KNOWN_RECIPES = ("fp16", "int8-dynamic", "int8-static", "int8-naive", "int8-timestep", "mixed", "int4-weights", "w4a8",
                 "weights-only", "fp8", "nvfp4")
SUFFIXES = {"": "host", "-loop": "loop", "-unrolled": "unrolled", "-dpmpp": "dpmpp"}
PEERS = {
    "optimum-ort": ("optimum", "fp32"),
    "openvino-fp32": ("openvino", "fp32"),
    "openvino-int8-hybrid": ("openvino", "int8-hybrid"),
    "sdcpp-fp32": ("sdcpp", "fp32"),
    "sdcpp-q8_0": ("sdcpp", "q8_0"),
    "sdcpp-q4_0": ("sdcpp", "q4_0"),
    "sdcpp-q4_K": ("sdcpp", "q4_K"),  # Z-Image / FLUX.2 [klein] (arch/sdcpp_files.py)
}
PEER_VENVS = {"optimum": ".venv-optimum", "openvino": ".venv-openvino", "sdcpp": ".venv-sdcpp"}
PEER_MODULES = {"optimum": "optimum.onnxruntime", "openvino": "optimum.intel", "sdcpp": "stable_diffusion_cpp"}
PEER_INSTALL_HINT = {
    "optimum": "run `make peers` (creates .venv-optimum with optimum-onnx[onnxruntime])",
    "openvino": "run `make peers` (creates .venv-openvino with bench/install_openvino.sh)",
    "sdcpp": "run `bash bench/install_sdcpp.sh` (compiles stable-diffusion.cpp into .venv-sdcpp)",
}


@dataclass
class VariantSpec:
    """One row of the bench. `kind` picks the runner: torch | ort | peer."""

    name: str
    kind: str
    label: str
    folder: Path | None = None  # ort: the model folder; torch / openvino: the diffusers folder; optimum: our folder
    sampler: str = "ddim"
    steps: int = 20
    loop: str = "host"  # host | loop | unrolled (ort only)
    precision: str = "fp32"  # fp32, or the quantization recipe
    peer: str | None = None  # optimum | openvino
    peer_mode: str | None = None  # fp32 | int8-hybrid
    peer_python: Path | None = None
    skip: str | None = None
    sampler_refusal: str | None = None  # a peer's one line when it cannot run the bench's sampler (variants._plan)
    decoder: str | None = None  # None: the VAE; tiny: the tiny autoencoder (ours: vae_decoder_tiny; peers: TAESD)
    hidden: bool = False  # listed only when asked for by name (a loop graph never compiled, quantized + DPM++)
    other_model: bool = False  # a quantized folder of a different model (never matched by a recipe name)
    requested: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["sampler_refusal"]  # already the row's skip reason where it applies
        for k in ("folder", "peer_python"):
            d[k] = str(d[k]) if d[k] is not None else None
        return d

    @property
    def host_loop(self) -> bool:
        """Per-step latents are visible (error curves need them)."""
        return self.kind in ("ort", "torch") and self.loop == "host"


def repo_root() -> Path:
    return models_root().parent


def peer_python(peer: str) -> Path:
    env = os.environ.get(f"ONNXDIFFUSION_{peer.upper()}_PYTHON")
    if env:
        return Path(env)
    return repo_root() / PEER_VENVS[peer] / "bin" / "python"


def source_folder(model: Path, manifest: Manifest) -> Path | None:
    """The diffusers folder a model was exported from (manifest `source.path`, else the embedded model's)."""
    src = manifest.source_path
    if src and (Path(src) / "model_index.json").is_file():
        return Path(src)
    emb = embedded_diffusers_folder()
    if model.resolve() == (emb.parent / f"{emb.name}-onnx").resolve() and (emb / "model_index.json").is_file():
        return emb
    return None


def recipe_of(manifest: Manifest | None) -> str | None:
    """The quantization recipe name of a model folder, or None for an fp32 export.

    Read from the manifest's `quantization` entry only (a string, or a `recipe` key holding a name or a
    dict with `name`, at the top or under `config`), so the bench does not depend on how quantize works.
    """
    q = manifest.quantization if manifest is not None else None
    if q is None:
        return None
    if isinstance(q, str):
        return q

    def find(d, depth=0):
        if not isinstance(d, Mapping) or depth > 3:
            return None
        r = d.get("recipe")
        if isinstance(r, str):
            return r
        if isinstance(r, dict) and isinstance(r.get("name"), str):
            return r["name"]
        for key in ("config", "settings"):
            got = find(d.get(key), depth + 1)
            if got:
                return got
        return None

    return find(q) or (q.get("name") if isinstance(q, Mapping) and isinstance(q.get("name"), str) else None) or "quantized"


def _run_components(manifest: Manifest) -> tuple[str, ...]:
    """What generation loads: the folder's family's text encoders, backbone and VAE decoder."""
    from ..families import get_family

    return get_family(manifest.family).required_components(manifest.pipeline)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def model_bytes(folder: Path, manifest: Manifest) -> int:
    """Bytes of what a run loads: the pipeline components (not vae_encoder, not sampling graphs)."""
    total = 0
    for name in _run_components(manifest):
        entry = manifest.component(name)
        if entry is None:
            continue
        comp = confined(folder, entry.path, f"component '{name}'").parent
        total += folder_bytes(comp) if comp.is_dir() else 0
    return total


def check_folder(folder: Path, manifest: Manifest | None = None, verify_hashes: bool = False) -> str | None:
    """None if a model folder looks runnable, else a one-line reason (missing manifest / component / file)."""
    try:
        manifest = manifest if manifest is not None else read_manifest(folder)
        if verify_hashes:
            verify_folder(folder, manifest)
        else:
            for name in _run_components(manifest):
                entry = manifest.component(name)
                if entry is None:
                    return f"manifest has no '{name}' component"
                if not (Path(folder) / entry.path).is_file():
                    return f"component '{name}' is missing ({entry.path})"
                for ext in entry.external_data:  # paths relative to the model folder
                    if not (Path(folder) / ext).is_file():
                        return f"external data of '{name}' is missing ({ext})"
            for rel in ("tokenizer", "scheduler/scheduler_config.json"):
                if not (Path(folder) / rel).exists():
                    return f"{rel} is missing"
    except UserError as e:
        return str(e)
    return None


def find_quantized(variants_dir: Path, base: Path) -> list[tuple[Path, Manifest]]:
    """Sub-folders of `variants_dir` holding a model folder whose manifest has a `quantization` entry."""
    out = []
    if not variants_dir.is_dir():
        return out
    for sub in sorted(variants_dir.iterdir()):
        if not sub.is_dir() or sub.resolve() == base.resolve():
            continue
        mpath = sub / MANIFEST
        if not mpath.is_file():
            continue
        try:
            manifest = read_manifest(sub)
        except UserError:  # not a folder this tool can run: not a variant
            continue
        if manifest.quantization is not None:
            out.append((sub, manifest))
    return out


def _loop_skip(manifest: Manifest, form: str, steps: int) -> str | None:
    graph = manifest.component(f"sampler_{form}")
    if graph is None:
        return f"no '{form}' sampling graph in this folder (run `onnxdiffusion compile-loop --form {form}`)"
    if form == "unrolled" and graph.steps != steps:
        return f"the unrolled graph runs exactly {graph.steps} steps; this bench runs {steps} (pass --steps {graph.steps})"
    return None


@dataclass(frozen=True)
class PlanOptions:
    steps: int = 20
    fast_steps: int = 10
    variants_dir: Path | None = None
    sampler: str = "ddim"  # the main rows' sampler (full-width archs: the folder's own)
    quantized: tuple[Path, ...] | None = None  # --quantize's folders: these instead of the model's siblings
    decoder: str | None = None  # tiny: every row decodes with the folder's tiny autoencoder (TAESD)


SAMPLER_LABELS = {"ddim": "DDIM", "euler": "Euler", "euler_a": "Euler ancestral", "flow_euler": "flow-match Euler",
                  "flow_heun": "flow-match Heun", "dpmpp_2m": "DPM-Solver++ 2M", "pndm": "PNDM (PLMS)",
                  "unipc": "UniPC", "lcm": "LCM", "tcd": "TCD"}


def plan_variants(model: Path, manifest: dict, source: Path | None, opts: PlanOptions) -> list[VariantSpec]:
    """Every variant this model can have, each runnable or carrying the reason it cannot run (with --decoder tiny
    every row decodes with the tiny autoencoder, or says why it cannot)."""
    specs = _plan(model, manifest, source, opts)
    if opts.decoder == "tiny":
        for s in specs:
            s.decoder = "tiny"
            s.label += " + tiny decoder"
            s.skip = s.skip or tiny_skip(s)
    return specs


def _plan(model: Path, manifest: dict, source: Path | None, opts: PlanOptions) -> list[VariantSpec]:
    specs: list[VariantSpec] = []
    ddim = f"{SAMPLER_LABELS.get(opts.sampler, opts.sampler)} {opts.steps}"
    fast = f"DPM-Solver++ 2M {opts.fast_steps}"

    torch_skip = None
    if source is None:
        torch_skip = "no diffusers source folder (manifest source.path is missing and this is not the embedded model)"
    else:
        import importlib.util

        missing = [m for m in ("torch", "diffusers", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            torch_skip = f"not installed: {', '.join(missing)} (the export extra: pip install -e '.[export]')"
    specs.append(VariantSpec("torch-fp32", "torch", f"PyTorch fp32 (diffusers), {ddim}", source, steps=opts.steps,
                             sampler=opts.sampler, skip=torch_skip))
    specs.append(VariantSpec("torch-bf16", "torch", f"PyTorch bf16 (diffusers), {ddim}", source, steps=opts.steps,
                             sampler=opts.sampler, precision="bf16", skip=torch_skip, hidden=True))

    def ort_family(prefix: str, folder: Path, man: Manifest, precision: str,
                   folder_skip: str | None) -> list[VariantSpec]:
        what = "ORT fp32" if precision == "fp32" else f"ORT {precision}"
        fam = [VariantSpec(f"{prefix}", "ort", f"{what}, host loop, {ddim}", folder, steps=opts.steps,
                           sampler=opts.sampler, precision=precision, skip=folder_skip)]
        for form in ("loop", "unrolled"):
            absent = f"sampler_{form}" not in man.components
            skip = folder_skip or _loop_skip(man, form, opts.steps)
            fam.append(VariantSpec(f"{prefix}-{form}", "ort", f"{what}, ONNX {form} graph, {ddim}", folder,
                                   steps=opts.steps, sampler=opts.sampler, loop=form, precision=precision, skip=skip,
                                   hidden=absent or folder_skip is not None))
        fam.append(VariantSpec(f"{prefix}-dpmpp", "ort", f"{what}, host loop, {fast}", folder, sampler="dpmpp_2m",
                               steps=opts.fast_steps, precision=precision, skip=folder_skip,
                               hidden=precision != "fp32" or folder_skip is not None))
        return fam

    specs += ort_family("ort-fp32", model, manifest, "fp32", check_folder(model, manifest))

    if opts.quantized is not None:  # --quantize: the folders this run built, plus --variants-dir's when given
        found = [(f, read_manifest(f)) for f in opts.quantized]
        found += find_quantized(opts.variants_dir, model) if opts.variants_dir is not None else []
    else:
        found = find_quantized(opts.variants_dir if opts.variants_dir is not None else model.parent, model)
    counts: dict[str, int] = {}
    for _, man in found:
        if man.pipeline == manifest.pipeline:
            r = recipe_of(man) or "quantized"
            counts[r] = counts.get(r, 0) + 1
    for folder, man in found:
        recipe = recipe_of(man) or "quantized"
        other_model = man.pipeline != manifest.pipeline
        if other_model:  # a quantized folder of some other model: listed only when asked for
            skip = f"{folder} is not a variant of {model.name} (its manifest's pipeline block differs)"
        else:
            skip = check_folder(folder, man)
        # one folder per recipe: ort-<recipe>; several: ort-<recipe>@<folder> (all of them match ort-<recipe>)
        prefix = f"ort-{recipe}" if counts.get(recipe, 0) == 1 and not other_model else f"ort-{recipe}@{folder.name}"
        for s in ort_family(prefix, folder, man, recipe, skip):
            s.notes.append(f"folder {shown_path(folder)}")
            s.hidden = s.hidden or other_model
            s.other_model = other_model
            specs.append(s)

    for name, (peer, mode) in PEERS.items():
        py = peer_python(peer)
        if peer == "optimum":
            folder, what = model, "Optimum ORTStableDiffusionPipeline on our folder"
        elif peer == "sdcpp":
            folder, what = source, f"stable-diffusion.cpp {mode} (GGUF from the diffusers source)"
        else:
            folder, what = source, f"OpenVINO (optimum-intel) {mode} on the diffusers source"
        skip = None
        kind = manifest.source_class or "StableDiffusionPipeline"
        # a peer that runs this kind of pipeline but not the bench's sampler is refused when named (core.py); one that
        # cannot take the pipeline at all stays an n/a row with that reason (as in a bench of several models)
        refusal = None if peer in ("optimum", "openvino") and kind != "StableDiffusionPipeline" else \
            peer_sampler_skip(peer, opts.sampler)
        if peer in ("optimum", "openvino") and kind != "StableDiffusionPipeline":  # peer_worker's SD1.x/2.x classes
            skip = f"the {peer} peer runs StableDiffusionPipeline folders only; this model is a {kind}"
        elif not py.exists():
            skip = f"peer not installed: no {shown_path(py)} ({PEER_INSTALL_HINT[peer]})"
        elif folder is None:
            skip = "no diffusers source folder for this model"
        elif peer == "sdcpp" and not _sd1_shaped(folder) and sdcpp_layout(folder) is None:
            skip = ("stable-diffusion.cpp builds SD1.x/2.x/XL networks by their fixed shapes (and Z-Image / FLUX.2 "
                    "[klein] from split files); this model is none of them")
        elif peer == "sdcpp" and mode not in (("q8_0", "q4_K") if sdcpp_layout(folder) else ("fp32", "q8_0", "q4_0")):
            skip = "sdcpp-fp32/q4_0 run SD1.x-shaped models, sdcpp-q4_K Z-Image / FLUX.2 [klein] (q8_0 both)"
        else:
            skip = refusal
        spec = VariantSpec(name, "peer", f"{what}, {ddim}", folder, steps=opts.steps, sampler=opts.sampler,
                           peer=peer, peer_mode=mode, precision=mode, peer_python=py, skip=skip,
                           sampler_refusal=refusal)
        if peer == "sdcpp" and opts.sampler == "ddim":
            spec.notes.append("sd.cpp's DDIM spaces the timesteps trailing (its ddim_trailing): the same update rule "
                              "and backbone calls as the other rows, other timesteps")
        specs.append(spec)
    return specs


def _sd1_shaped(diffusers_folder: Path) -> bool:
    try:
        cfg = json.loads((Path(diffusers_folder) / StableDiffusion.backbone / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return list(cfg.get("block_out_channels", [])) == [320, 640, 1280, 1280] and cfg.get("cross_attention_dim") == 768


def folder_variant(folder: Path, base: Path, base_manifest: Manifest, steps: int, sampler: str = "ddim") -> VariantSpec:
    """A model folder given by path in --variants: its host-loop variant (the bench's sampler), named after its recipe."""
    folder = Path(folder)
    skip = check_folder(folder)
    man = None
    if skip is None:
        man = read_manifest(folder)
        if man.pipeline != base_manifest.pipeline:
            skip = f"not the same model as {base.name} (its manifest's pipeline block differs)"
    recipe = recipe_of(man) or "fp32"
    name = f"ort-{recipe}@{folder.name}"
    return VariantSpec(name, "ort", f"ORT {recipe} ({folder.name}), host loop, {SAMPLER_LABELS.get(sampler, sampler)} "
                                    f"{steps}", folder, steps=steps, sampler=sampler, precision=recipe, skip=skip,
                       notes=[f"folder {shown_path(folder)}"])


def variant_pattern_ok(name: str) -> bool:
    """Whether a name is one the bench knows how to make (it may still be absent from this model)."""
    if name in PEERS or name in ("torch-fp32", "torch-bf16"):
        return True
    if not name.startswith("ort-"):
        return False
    rest = name[4:].split("@", 1)[0]
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if suffix and rest.endswith(suffix):
            rest = rest[: -len(suffix)]
            break
    return rest == "fp32" or rest in KNOWN_RECIPES


def _split_name(name: str) -> tuple[str, str]:
    """'ort-int8-static-loop' -> ('int8-static', 'loop'); 'ort-fp16' -> ('fp16', 'host')."""
    rest = name[4:]
    for suffix, form in SUFFIXES.items():
        if suffix and rest.endswith(suffix):
            return rest[: -len(suffix)], form
    return rest, "host"


def _same_recipe(specs: list[VariantSpec], name: str) -> list[VariantSpec]:
    """For a recipe found in several folders (named ort-<recipe>@<folder>...), the specs a plain name means."""
    if not name.startswith("ort-") or "@" in name:
        return []
    recipe, form = _split_name(name)
    out = []
    for s in specs:
        if s.kind != "ort" or s.other_model or s.precision != recipe or not s.name.startswith(f"ort-{recipe}@"):
            continue
        s_form = "dpmpp" if s.name.endswith("-dpmpp") else s.loop
        if s_form == form:
            out.append(s)
    return out


def select(specs: list[VariantSpec], names: list[str] | None, variants_dir: Path | None = None) -> list[VariantSpec]:
    """Filter the plan by --variants names (all by default). Unknown names fail before anything runs."""
    by_name = {s.name: s for s in specs}
    if not names or names == ["all"]:
        return [s for s in specs if not s.hidden]
    flat = [n.strip() for item in names for n in item.split(",") if n.strip()]
    unknown = [n for n in flat if n not in by_name and not variant_pattern_ok(n)]
    if unknown:
        known = ", ".join(sorted(by_name))
        raise UserError(f"unknown variant {unknown[0]!r}; known here: {known} "
                        f"(or ort-<recipe>[-loop|-unrolled|-dpmpp] for recipes {', '.join(KNOWN_RECIPES)})")
    out: list[VariantSpec] = []
    for n in dict.fromkeys(flat):
        several = [] if n in by_name else _same_recipe(specs, n)
        if several:  # a recipe with several folders: all of them
            for s in several:
                s.requested = True
                out.append(s)
            continue
        if n in by_name:
            s = by_name[n]
        else:
            where = variants_dir if variants_dir is not None else "the model's sibling folders"
            recipe = n[4:]
            for suffix in ("-loop", "-unrolled", "-dpmpp"):
                if recipe.endswith(suffix):
                    recipe = recipe[: -len(suffix)]
            s = VariantSpec(n, "ort", n, None, skip=f"no model folder with quantization recipe '{recipe}' in {where} "
                                                    f"(make one with `onnxdiffusion quantize MODEL OUT --recipe {recipe}`)")
        s.requested = True
        out.append(s)
    return out
