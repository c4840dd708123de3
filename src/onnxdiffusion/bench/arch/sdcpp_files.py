"""The weight files stable-diffusion.cpp reads for a diffusers Z-Image or FLUX.2 [klein] folder (`bench`'s sdcpp peer).

sd.cpp loads these families from three files (--diffusion-model, --llm, --vae) and recognises the family by the
ORIGINAL release's tensor names (Z-Image's fused `attention.qkv` and `cap_embedder`; FLUX.2's `double_blocks`,
`double_stream_modulation_img.lin`, `single_blocks.N.linear1`): its own diffusers-name converter covers FLUX.1's
layout, not FLUX.2's. So the diffusers shards are rewritten to the original names (the inverse of diffusers'
single-file converters): fused projections are their parts' rows concatenated, FLUX.2's final modulation has its
(scale, shift) halves swapped back to (shift, scale). The text encoder keeps Hugging Face's names under `model.`
(the layout of the released Qwen3-4B) with its embedding padded to Qwen's 151936 rows: sd.cpp tokenizes with its
own copy of Qwen's vocabulary. The VAE is diffusers' file as is (sd.cpp maps diffusers' VAE names itself).

Standard library only: the peer worker runs this in the sd.cpp venv, which has no torch and whose numpy reads
no bf16. Tensors are byte ranges of the source files (safetensors is a JSON header then row-major raw data), so a
fused tensor is its parts' ranges in order and nothing is held but one range at a time.

    python sdcpp_files.py DIFFUSERS_FOLDER OUT_DIR     # writes diffusion.safetensors, llm.safetensors; prints JSON
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

QWEN_VOCAB = 151936
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
CHUNK = 64 * 2**20


def layout(folder: Path) -> str | None:
    """'zimage' | 'flux2' for a folder sd.cpp reads from split files, else None (model_index.json's class)."""
    try:
        cls = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name", "")
    except (OSError, ValueError):
        return None
    return {"ZImagePipeline": "zimage", "Flux2KleinPipeline": "flux2"}.get(cls)


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor table, byte offset of the data) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise ValueError(f"{path.name}: safetensors header of {n} bytes")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensors(component: Path) -> dict[str, tuple[Path, dict, int]]:
    """name -> (file, header entry, data offset) over a component folder's shards."""
    out = {}
    for file in sorted(component.glob("*.safetensors")):
        header, base = read_header(file)
        for name, entry in header.items():
            out[name] = (file, entry, base)
    return out


_ZIMAGE = ((r"^all_x_embedder\.2-1\.", "x_embedder."), (r"^all_final_layer\.2-1\.", "final_layer."),
           (r"\.attention\.to_out\.0\.", ".attention.out."), (r"\.attention\.norm_q\.", ".attention.q_norm."),
           (r"\.attention\.norm_k\.", ".attention.k_norm."))
_FLUX2 = ((r"^x_embedder\.", "img_in."), (r"^context_embedder\.", "txt_in."),
          (r"^time_guidance_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
          (r"^time_guidance_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
          (r"^time_guidance_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
          (r"^time_guidance_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
          (r"_modulation(_img|_txt)?\.linear\.", r"_modulation\1.lin."), (r"^proj_out\.", "final_layer.linear."),
          (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
          (r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
          (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
          (r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
          (r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
          (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
          (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
          (r"^transformer_blocks\.(\d+)\.ff\.linear_in\.", r"double_blocks.\1.img_mlp.0."),
          (r"^transformer_blocks\.(\d+)\.ff\.linear_out\.", r"double_blocks.\1.img_mlp.2."),
          (r"^transformer_blocks\.(\d+)\.ff_context\.linear_in\.", r"double_blocks.\1.txt_mlp.0."),
          (r"^transformer_blocks\.(\d+)\.ff_context\.linear_out\.", r"double_blocks.\1.txt_mlp.2."),
          (r"^single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj\.", r"single_blocks.\1.linear1."),
          (r"^single_transformer_blocks\.(\d+)\.attn\.to_out\.", r"single_blocks.\1.linear2."),
          (r"^single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
          (r"^single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"))
# fused row chunks: (pattern, replacement, part index of 3)
_FUSED = {
    "zimage": ((r"\.attention\.to_([qkv])\.", r".attention.qkv."),),
    "flux2": ((r"^transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"double_blocks.\1.img_attn.qkv."),
              (r"^transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj\.", r"double_blocks.\1.txt_attn.qkv.")),
}


def original_name(kind: str, name: str) -> tuple[str, int]:
    """A diffusers backbone tensor name -> (the original release's name, row-chunk index: q/k/v = 0/1/2, else 0)."""
    for pattern, repl in _FUSED[kind]:
        m = re.search(pattern, name)
        if m:
            return re.sub(pattern, repl, name), "qkv".index(m.group(m.lastindex))
    for pattern, repl in (_ZIMAGE if kind == "zimage" else _FLUX2):
        name = re.sub(pattern, repl, name)
    return name, 0


def _ranges(file: Path, entry: dict, base: int) -> list[tuple[Path, int, int]]:
    a, b = entry["data_offsets"]
    return [(file, base + a, b - a)]


def backbone_plan(kind: str, component: Path) -> dict[str, dict]:
    """Original name -> {dtype, shape, pieces: [(file, offset, length) | (None, 0, zero bytes)]}."""
    groups: dict[str, list] = {}
    for name, (file, entry, base) in tensors(component).items():
        out, part = original_name(kind, name)
        groups.setdefault(out, []).append((part, file, entry, base))
    plan = {}
    for out, parts in groups.items():
        parts.sort(key=lambda p: p[0])
        shape = list(parts[0][2]["shape"])
        shape[0] = sum(p[2]["shape"][0] for p in parts)
        pieces = [r for _, f, e, b in parts for r in _ranges(f, e, b)]
        if out.startswith("final_layer.adaLN_modulation.1.") and kind == "flux2":  # (scale, shift) -> (shift, scale)
            (file, off, n), = pieces
            pieces = [(file, off + n // 2, n // 2), (file, off, n // 2)]
        plan[out] = {"dtype": parts[0][2]["dtype"], "shape": shape, "pieces": pieces}
    return plan


def llm_plan(component: Path) -> dict[str, dict]:
    """The text encoder under Hugging Face's `model.` names, the embedding padded to Qwen's vocabulary."""
    plan = {}
    for name, (file, entry, base) in tensors(component).items():
        if name.startswith("lm_head."):
            continue
        out = name if name.startswith("model.") else "model." + name
        shape, pieces = list(entry["shape"]), _ranges(file, entry, base)
        if out == "model.embed_tokens.weight" and shape[0] < QWEN_VOCAB:
            pieces.append((None, 0, (QWEN_VOCAB - shape[0]) * shape[1] * _DTYPE_BYTES[entry["dtype"]]))
            shape[0] = QWEN_VOCAB
        plan[out] = {"dtype": entry["dtype"], "shape": shape, "pieces": pieces}
    return plan


def write(plan: dict[str, dict], path: Path) -> int:
    """One safetensors file from a plan, a piece at a time, staged then renamed; returns its bytes."""
    header, offset = {}, 0
    for name, t in plan.items():
        n = sum(p[2] for p in t["pieces"])
        header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for t in plan.values():
            for file, off, n in t["pieces"]:
                if file is None:
                    out.write(bytes(n))
                    continue
                with open(file, "rb") as f:
                    f.seek(off)
                    while n > 0:
                        chunk = f.read(min(n, CHUNK))
                        if not chunk:
                            raise ValueError(f"{file.name}: shorter than its header says")
                        out.write(chunk)
                        n -= len(chunk)
    tmp.replace(path)
    return path.stat().st_size


def prepare(folder: Path, out: Path) -> dict[str, Path]:
    """diffusion / llm / vae files for sd.cpp from a diffusers folder (rewritten once, reused when present)."""
    folder, out = Path(folder), Path(out)
    kind = layout(folder)
    if kind is None:
        raise ValueError(f"{folder}: not a Z-Image or FLUX.2 [klein] diffusers folder")
    out.mkdir(parents=True, exist_ok=True)
    files = {"diffusion": out / "diffusion.safetensors", "llm": out / "llm.safetensors",
             "vae": folder / "vae" / "diffusion_pytorch_model.safetensors"}
    if not files["diffusion"].is_file():
        write(backbone_plan(kind, folder / "transformer"), files["diffusion"])
    if not files["llm"].is_file():
        write(llm_plan(folder / "text_encoder"), files["llm"])
    return files


if __name__ == "__main__":
    print(json.dumps({k: str(v) for k, v in prepare(Path(sys.argv[1]), Path(sys.argv[2])).items()}))
