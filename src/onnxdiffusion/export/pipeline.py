"""`export`: a local diffusers pipeline folder -> an ONNX model folder, driven by the model's family."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path

from .. import __version__
from ..folder.artifacts import FORMAT_VERSION, atomic_dir, check_output_folder, hash_tree, write_json, write_manifest
from ..folder.artifacts import read_json_object as _read_json
from ..errors import UserError
from ..families import Family, family_for_pipeline
from ..families.base import class_of
from ..folder.manifest import Manifest, PipelineInfo, typed
from ..onnxio import HeapFrozen
from . import family_export
from .options import ExportOptions

OPSET_RANGE = (14, 20)  # attention export needs 14; torch's TorchScript exporter stops at 20


def _check_source(src: Path) -> tuple[Family, dict, dict[str, dict]]:
    """The family, model_index and every JSON config export needs, checked before torch loads anything."""
    if not src.exists():
        raise UserError(f"source folder not found: {src}")
    index = src / "model_index.json"
    if not src.is_dir() or not index.is_file():
        raise UserError(f"{src} is not a diffusers pipeline folder (no model_index.json)")
    mi = _read_json(index)
    family = family_for_pipeline(mi.get("_class_name"))
    present = {p.name for p in src.iterdir() if p.is_dir()}
    family.check_source(str(src), mi, present)
    configs: dict[str, dict] = {"model_index": mi}
    sched_path = src / "scheduler" / "scheduler_config.json"
    if not sched_path.is_file():
        raise UserError(f"{src}: scheduler/scheduler_config.json is missing")
    configs["scheduler"] = _read_json(sched_path)
    from ..folder.manifest import check_scheduler_config
    from ..samplers import schedule_from_config

    try:
        schedule_from_config(check_scheduler_config(configs["scheduler"], str(sched_path)))
    except (ValueError, TypeError) as e:
        raise UserError(f"{sched_path}: {str(e).splitlines()[0][:300]}") from None
    for slot in family.text_encoders:
        if class_of(mi, slot.name) is None:
            continue
        configs[slot.name] = _read_json(src / slot.name / "config.json")
        tok_cfg = src / slot.tokenizer / "tokenizer_config.json"
        configs[f"{slot.tokenizer}/tokenizer_config"] = _read_json(tok_cfg) if tok_cfg.is_file() else {}
    for rel in family.source_configs:  # more JSON a family reads (an editing model's processor config)
        path = src / rel
        if not path.is_file():
            raise UserError(f"{src}: {rel} is missing")
        configs[rel.removesuffix(".json")] = _read_json(path)
    for name in (family.backbone, "vae"):
        path = src / name / "config.json"
        if not path.is_file():
            raise UserError(f"{src}: {name}/config.json is missing")
        configs[name] = _read_json(path)
    return family, mi, configs


def _source_path(src: Path) -> str:
    """The source folder relative to the working directory when it lies inside it (a shipped manifest names no
    absolute path of the machine that exported it), else absolute."""
    resolved = src.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(resolved)


def source_info(src: Path | str) -> tuple[Family, PipelineInfo]:
    """The family and pipeline settings (what the manifest's `pipeline` records) of a diffusers folder, from its
    JSON only."""
    family, _, configs = _check_source(Path(src))
    return family, PipelineInfo.from_dict(family.pipeline_info(configs))


def _recommended(src: Path) -> dict:
    """Settings the model was evaluated with (eval.json beside the diffusers folder, written by training)."""
    from ..folder.manifest import check_recommended

    try:
        opts = json.loads((src / "eval.json").read_text())["options"]
        rec = {k: opts[k] for k in ("guidance", "steps", "sampler") if k in opts}
        return check_recommended(rec, str(src / "eval.json"))
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return {}


def _versions() -> dict:
    import diffusers
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "onnxdiffusion": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def _load(src: Path, name: str, class_name: str):
    """from_pretrained of a class the family accepted (never a class name taken unchecked from the folder)."""
    import diffusers
    import transformers

    cls = getattr(diffusers, class_name, None) or getattr(transformers, class_name, None)
    if cls is None:
        raise UserError(f"{src}: component class {class_name!r} is not available in this diffusers/transformers")
    try:
        return cls.from_pretrained(src / name, local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {src / name}: {first}") from None


def _load_source(src: Path, name: str, class_name: str, family: Family, options: ExportOptions, reports: dict,
                 kind: str = ""):
    """A component's torch module: from the folder, or the backbone from options.gguf (its report kept)."""
    if kind == "decoder_text_encoder":
        from . import llm_streamed

        if llm_streamed.wanted(src / name, options):  # an LLM's weights left in its shards (issue 43)
            return llm_streamed.build_encoder(src / name, class_name, options.text_encoder_weights)
    if options.gguf is None or name != family.backbone:
        from .streamed_float import build_backbone as build_streamed
        from .streamed_float import should_stream

        if name == family.backbone and not options.loras and should_stream(src / name, options.stream_weights):
            return build_streamed(src / name, class_name)  # Linear weights left in the shards (issue 43)
        return _load(src, name, class_name)
    from .gguf_backbone import build_backbone
    from .gguf_file import read_gguf

    module, reports[name] = build_backbone(read_gguf(options.gguf), family, class_name, src / name,
                                           options.gguf_layout)
    return module


def _gguf_entry(entry: dict, report: dict | None) -> None:
    if report is not None:
        from .gguf_backbone import precision_label

        entry["precision"] = precision_label(report)
        entry["gguf"] = report


def _save_tokenizer(src: Path, name: str, class_name: str, out: Path) -> None:
    """Re-save as a fast tokenizer: the run time reads tokenizer.json with the `tokenizers` library."""
    import transformers

    fast = class_name if class_name.endswith("Fast") else class_name + "Fast"
    # a processor (FLUX.2 [dev]'s PixtralProcessor) holds the tokenizer its tokenizer_config.json names
    cls = transformers.AutoTokenizer if class_name.endswith("Processor") else getattr(transformers, fast)
    try:
        tok = cls.from_pretrained(src / name, local_files_only=True)
    except (OSError, ValueError, RuntimeError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load tokenizer {src / name}: {first}") from None
    tok.save_pretrained(out / name)


def _chat_templates(src: Path, family: Family, model_index: dict) -> dict[str, str]:
    """Each chat-template encoder's template, rendered once from its tokenizer folder (families/base.py
    TextEncoderSlot.chat_template): the run time formats the prompt into it."""
    import transformers

    from .llm_text_encoder import chat_prompt_template

    out = {}
    for slot in family.text_encoders:
        cls = class_of(model_index, slot.tokenizer)
        if slot.chat_template is None or cls is None:
            continue
        fast = cls if cls.endswith("Fast") else cls + "Fast"
        try:
            tok = getattr(transformers, fast).from_pretrained(src / slot.tokenizer, local_files_only=True)
            out[slot.name] = chat_prompt_template(tok, slot.chat_template)
        except Exception as e:  # a folder's tokenizer or template (jinja's own errors too): one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{src / slot.tokenizer}: no usable chat template ({first})") from None
    return out


def _check_tiny(family: Family, configs: dict, options: ExportOptions) -> tuple[tuple[str, ...], dict | None]:
    """--tiny-vae: the halves it adds (skippable like optional components) and its checked config."""
    if options.tiny_vae is None:
        return (), None
    from .tiny_vae import TINY_NAMES, check_tiny_source

    cfg = check_tiny_source(options.tiny_vae, family, PipelineInfo.from_dict(family.pipeline_info(configs)))
    if all(n in options.skip for n in TINY_NAMES):
        raise UserError("--tiny-vae with both its halves skipped exports nothing of it")
    return TINY_NAMES, cfg


def _check_controlnets(options: ExportOptions, family: Family, configs: dict) -> list[tuple[str, str, dict]]:
    """--controlnet NAME=DIR: each folder checked against the backbone before torch loads anything."""
    if not options.controlnets:
        return []
    from .controlnet import check_source, parse_pairs

    info = PipelineInfo.from_dict(family.pipeline_info(configs))
    return [(name, path, check_source(path, family, info, configs[family.backbone]))
            for name, path in parse_pairs(options.controlnets)]  # a net that borrows the backbone reads it from src


def _check_options(options: ExportOptions) -> None:
    if isinstance(options.opset, bool) or not isinstance(options.opset, int) \
            or not OPSET_RANGE[0] <= options.opset <= OPSET_RANGE[1]:
        raise UserError(f"--opset must be in [{OPSET_RANGE[0]}, {OPSET_RANGE[1]}], got {options.opset!r}")
    if options.stream_weights not in ("auto", "on", "off"):
        raise UserError(f"--stream-weights must be auto, on or off, got {options.stream_weights!r}")
    if options.text_encoder_weights not in ("float", "int8", "int4"):
        raise UserError(f"--text-encoder-weights must be float, int8 or int4, got {options.text_encoder_weights!r}")
    from .gguf_backbone import check_layout

    check_layout(options.gguf_layout)
    if options.gguf_layout != "blocks" and options.gguf is None:
        raise UserError(f"--gguf-layout {options.gguf_layout}: a GGUF source only (export MODEL.gguf OUT --base DIR)")


def export_pipeline(src: Path | str, out: Path | str, options: ExportOptions | None = None,
                    progress: bool = True) -> Manifest:
    """Export every component of a local diffusers pipeline to ONNX, validate it, write a draft.

    Returns the manifest written. Raises UserError on bad input or a component over its tolerance;
    nothing is left at `out` unless the whole export succeeds. Components are loaded one source
    folder at a time and released after export, so peak memory follows the largest component.
    """
    options = options or ExportOptions()
    src, out = Path(src), Path(out)
    _check_options(options)
    family, model_index, configs = _check_source(src)
    tiny_names, tiny_cfg = _check_tiny(family, configs, options)
    check_output_folder(out, options.overwrite, inputs=(src,))  # before torch is imported (seconds)
    from ..adapters import export_lora

    lora_records = export_lora.before_export(options, configs)
    controlnets = _check_controlnets(options, family, configs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
    except ImportError as e:
        raise UserError(f"export needs the export extra (pip install 'onnxdiffusion[export]'): {e}") from None
    from tqdm import tqdm

    from . import llm_streamed
    from .attention import DOMAIN_OP, fuse_attention
    from .streamed_backbone import cut_validation, export_streamed
    from .streamed_float import streamed_floats
    from .validate import export_component, free_memory

    t_start = time.time()
    settings = {**family.pipeline_info(configs), **family_export.source_settings(family, src, model_index)}
    if templates := _chat_templates(src, family, model_index):
        settings["chat_templates"] = templates
    if options.default_size is not None:
        m = int(settings["size_multiple"])
        if options.default_size <= 0 or options.default_size % m:
            raise UserError(f"default size must be a positive multiple of {m} for this model, got {options.default_size}")
        settings["default_height"] = settings["default_width"] = int(options.default_size)
    info = PipelineInfo.from_dict(settings)
    present = {n for n in configs if "/" not in n and n not in ("model_index", "scheduler")}
    specs = family.component_specs(info, present)
    wanted = options.components
    if wanted is not None:
        unknown = [n for n in wanted if n not in specs]
        if unknown:
            raise UserError(f"unknown component(s) {unknown} for a {family.name} pipeline; have {list(specs)}")
        specs = {k: v for k, v in specs.items() if k in wanted}
    if options.skip:
        needed = family.required_components(info)
        bad = [n for n in options.skip if n not in specs and n not in tiny_names or n in needed]
        if bad:
            raise UserError(f"cannot skip {bad}: a {family.name} pipeline's optional components here are "
                            f"{[n for n in specs if n not in needed]}")
        specs = {k: v for k, v in specs.items() if k not in options.skip}
    if options.text_encoder_weights != "float" and not any(s.kind == "decoder_text_encoder" for s in specs.values()):
        raise UserError(f"--text-encoder-weights {options.text_encoder_weights}: this export has no LLM text encoder")
    fused: dict[str, int] = {}
    gguf_reports: dict[str, dict] = {}
    draft: dict = {
        "format_version": FORMAT_VERSION,
        "family": family.name,
        "source": {"path": _source_path(src), "class": model_index["_class_name"]},
        "opset": options.opset,
        "exporter": "torch.onnx.export (TorchScript)",
        "tool_versions": _versions(),
        "attention": {"fused": False},
        "pipeline": info.to_dict(),
        "components": {},
        "recommended": _recommended(src),
    }
    with HeapFrozen() as heap, atomic_dir(out, overwrite=options.overwrite, inputs=(src,)) as tmp:
        with tqdm(total=len(specs), desc="export", disable=not progress) as bar:  # closed (newline) on errors too
            loaded: tuple[str, object] | None = None
            module = wrapped = None
            order = list(specs.values())
            for i, (name, spec) in enumerate(specs.items()):
                bar.set_postfix_str(name)
                if loaded is None or loaded[0] != spec.source:
                    loaded = module = None  # release the previous source's weights before loading the next
                    heap.settle()
                    module = _load_source(src, spec.source, class_of(model_index, spec.source), family, options,
                                          gguf_reports, spec.kind)
                    export_lora.fuse(module, spec.source, lora_records)
                    if options.fuse_attention and spec.kind != "text_encoder":
                        fused[spec.source] = fuse_attention(module)
                    loaded = (spec.source, module)
                module = loaded[1]
                vocab = int(getattr(module.config, "vocab_size", 0) or 0)
                dims = family.export_dims(spec, info)
                gen = torch.Generator().manual_seed(0)
                feed_list = [family_export.export_feeds(family, spec, d, gen, vocab) for d in dims]
                last_of_source = i + 1 == len(order) or order[i + 1].source != spec.source
                llm_weights = llm_streamed.streams(module)  # an LLM text encoder left in its shards

                def release() -> None:
                    # the source's last component: drop the torch weights before ONNX Runtime loads the export
                    nonlocal loaded, module, wrapped
                    loaded = module = wrapped = None

                if streamed_floats(module) or cut_validation(module, options.stream_weights):
                    entry = export_streamed(spec, module, lambda m: family_export.wrap(family, spec, m).eval(),
                                            feed_list, tmp / name, options, release if last_of_source else None)
                else:
                    wrapped = family_export.wrap(family, spec, module).eval()
                    entry = export_component(spec, wrapped, feed_list, tmp / name, options,
                                             release=release if last_of_source else None)
                wrapped = None
                if llm_weights:
                    llm_streamed.record(entry, options.text_encoder_weights)
                entry["family"] = family.name
                _gguf_entry(entry, gguf_reports.get(spec.source))
                entry["shapes_validated"] = dims
                draft["components"][name] = entry
                if (src / spec.source / "config.json").is_file():
                    shutil.copy2(src / spec.source / "config.json", tmp / name / "config.json")
                bar.update(1)
        loaded = module = None
        free_memory()
        if tiny_cfg is not None:
            from .tiny_vae import export_tiny

            draft["components"].update(export_tiny(options.tiny_vae, tiny_cfg, family, info, tmp, options,
                                                      tuple(n for n in tiny_names if n not in options.skip)))
        if controlnets:
            from .controlnet import export_controlnet

            from .controlnet import backbone_source

            draft["controlnets"] = {name: export_controlnet(
                name, path, rec, family, info, tmp, options,
                backbone_source(rec, src, family, configs[family.backbone])) for name, path, rec in controlnets}
        if any(fused.values()):
            draft["attention"] = {"fused": True, "op": DOMAIN_OP.replace("::", "."), "modules": fused}
        for slot in family.text_encoders:
            if slot.name in specs:
                _save_tokenizer(src, slot.tokenizer, class_of(model_index, slot.tokenizer), tmp)
        (tmp / "scheduler").mkdir()
        shutil.copy2(src / "scheduler" / "scheduler_config.json", tmp / "scheduler" / "scheduler_config.json")
        write_json(tmp / "model_index.json", model_index)
        export_lora.after_export(tmp, draft, options, lora_records)
        draft["export_seconds"] = round(time.time() - t_start, 2)
        draft["files"] = hash_tree(tmp)
        write_manifest(tmp, draft)
    return typed(draft, str(out))
