"""How a family's GGUF backbone files name their tensors (export MODEL.gguf; export/gguf.py applies it).

Community GGUF files keep the names of the checkpoint they were converted from: some use diffusers' own module
names (Qwen-Image), others the original release's (Z-Image: `x_embedder`, one fused `attention.qkv`, ...). A
family declares the mapping as data: the `general.architecture` labels its files carry, prefixes to strip,
substring renames in order, fused tensors split into equal row chunks, tensors whose row chunks come in another
order (FLUX.2's final modulation: (shift, scale) in the release, (scale, shift) in diffusers), and tensors diffusers
does not use. Every split and reorder is on whole rows: a GGUF block never spans two rows (blocks run along a
row), so a block-quantized tensor (Q8_0, Q4_0, the K types) splits and reorders without touching a block.
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
    # a (renamed) tensor's name part -> the order of its equal row chunks in diffusers' tensor
    reordered: tuple[tuple[str, tuple[int, ...]], ...] = ()
    dropped: tuple[str, ...] = ()

    def map(self, name: str) -> list[tuple[str, tuple[int, ...], int]]:
        """A file's tensor name -> [(diffusers name, the row chunks it is made of in order, chunk count)]; [] for a
        dropped tensor."""
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
                return [(name.replace(part, p), (i,), len(parts)) for i, p in enumerate(parts)]
        for part, order in self.reordered:
            if part in name:
                return [(name, order, len(order))]
        return [(name, (0,), 1)]


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


# FLUX.2's files (city96's and sd.cpp's, converted from the release) keep the release's names: double blocks with one
# fused qkv per stream, `img_in` / `txt_in`, `time_in` / `guidance_in`, `.lin` modulations, the final layer's
# adaLN modulation with its (shift, scale) halves in the release's order. diffusers' single-file converter's mapping
# as data (bench/arch/sdcpp_files.py writes the inverse): each qkv split into q, k, v rows; the single blocks'
# fused linear1 (qkv and the MLP's input) is diffusers' `to_qkv_mlp_proj` as it is, so it is not split. The
# renames run in order: the blocks' own parts first, their prefixes last.
FLUX2 = GgufNames(
    architectures=("flux2", "flux"),
    renames=(("img_in.", "x_embedder."), ("txt_in.", "context_embedder."),
             ("time_in.in_layer.", "time_guidance_embed.timestep_embedder.linear_1."),
             ("time_in.out_layer.", "time_guidance_embed.timestep_embedder.linear_2."),
             ("guidance_in.in_layer.", "time_guidance_embed.guidance_embedder.linear_1."),
             ("guidance_in.out_layer.", "time_guidance_embed.guidance_embedder.linear_2."),
             ("_modulation_img.lin.", "_modulation_img.linear."), ("_modulation_txt.lin.", "_modulation_txt.linear."),
             ("_modulation.lin.", "_modulation.linear."),
             ("final_layer.adaLN_modulation.1.", "norm_out.linear."), ("final_layer.linear.", "proj_out."),
             (".img_attn.norm.query_norm.scale", ".attn.norm_q.weight"),
             (".img_attn.norm.key_norm.scale", ".attn.norm_k.weight"),
             (".txt_attn.norm.query_norm.scale", ".attn.norm_added_q.weight"),
             (".txt_attn.norm.key_norm.scale", ".attn.norm_added_k.weight"),
             (".img_attn.proj.", ".attn.to_out.0."), (".txt_attn.proj.", ".attn.to_add_out."),
             (".img_mlp.0.", ".ff.linear_in."), (".img_mlp.2.", ".ff.linear_out."),
             (".txt_mlp.0.", ".ff_context.linear_in."), (".txt_mlp.2.", ".ff_context.linear_out."),
             (".linear1.", ".attn.to_qkv_mlp_proj."), (".linear2.", ".attn.to_out."),
             (".norm.query_norm.scale", ".attn.norm_q.weight"), (".norm.key_norm.scale", ".attn.norm_k.weight"),
             ("double_blocks.", "transformer_blocks."), ("single_blocks.", "single_transformer_blocks.")),
    fused=((".img_attn.qkv.", (".attn.to_q.", ".attn.to_k.", ".attn.to_v.")),
           (".txt_attn.qkv.", (".attn.add_q_proj.", ".attn.add_k_proj.", ".attn.add_v_proj."))),
    reordered=(("norm_out.linear.", (1, 0)),),
)
