"""How a family's GGUF backbone files name their tensors (export MODEL.gguf; export/gguf.py applies it).

Community GGUF files keep the names of the checkpoint they were converted from: some use diffusers' own module
names (Qwen-Image), others the original release's (Z-Image: `x_embedder`, one fused `attention.qkv`, ...). A
family declares the mapping as data: the `general.architecture` labels its files carry, prefixes to strip,
substring renames in order, fused tensors split into equal row chunks, and tensors diffusers does not use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgufNames:
    # general.architecture labels of this family's files; a file with another label is refused
    architectures: tuple[str, ...]
    prefixes: tuple[str, ...] = ("model.diffusion_model.",)
    renames: tuple[tuple[str, str], ...] = ()
    # a fused tensor's name part -> the name parts of its row chunks (output rows are independent: a block-wise
    # quantized tensor splits exactly)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    dropped: tuple[str, ...] = ()

    def map(self, name: str) -> list[tuple[str, int, int]]:
        """A file's tensor name -> [(diffusers name, chunk index, chunk count)]; [] for a dropped tensor."""
        for p in self.prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        if name in self.dropped:
            return []
        for old, new in self.renames:
            name = name.replace(old, new)
        for part, parts in self.fused:
            if part in name:
                return [(name.replace(part, p), i, len(parts)) for i, p in enumerate(parts)]
        return [(name, 0, 1)]


# Z-Image's files (ComfyUI-GGUF labels them lumina2) keep the original release's names, diffusers' single-file
# converter's mapping as data: one fused qkv per attention, `out` for to_out.0, q_norm/k_norm, the embedder and final
# layer of the one patch size, and the final norm diffusers has no use for. The zimage family declares
# `gguf_names = Z_IMAGE`.
Z_IMAGE = GgufNames(
    architectures=("lumina2", "z_image"),
    renames=(("final_layer.", "all_final_layer.2-1."), ("x_embedder.", "all_x_embedder.2-1."),
             (".attention.out.", ".attention.to_out.0."), (".attention.k_norm.", ".attention.norm_k."),
             (".attention.q_norm.", ".attention.norm_q.")),
    fused=((".attention.qkv.", (".attention.to_q.", ".attention.to_k.", ".attention.to_v.")),),
    dropped=("norm_final.weight",),
)
