"""A diffusers SD1.x pipeline written as an original (LDM / A1111 / ComfyUI) single-file checkpoint: the key
mapping diffusers' single-file loader reverses, written here as its inverse so the round trip can be tested."""

from __future__ import annotations

import re
from pathlib import Path

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _resnet(rest: str, table=_RESNET) -> str:
    head, _, tail = rest.partition(".")
    return f"{table.get(head, head)}.{tail}"


def unet_key(key: str, cfg: dict) -> str:
    n = cfg["layers_per_block"]
    fixed = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
             "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2.",
             "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2."}
    for a, b in fixed.items():
        if key.startswith(a):
            return b + key[len(a):]
    if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        return f"input_blocks.{(n + 1) * i + j + 1}." + (f"0.{_resnet(rest)}" if kind == "resnets" else f"1.{rest}")
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
        return f"input_blocks.{(n + 1) * (int(m[1]) + 1)}.0.op.{m[2]}"
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", key):
        return f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
    if m := re.match(r"mid_block\.attentions\.0\.(.*)", key):
        return f"middle_block.1.{m[1]}"
    if m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key):
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        return f"output_blocks.{(n + 1) * i + j}." + (f"0.{_resnet(rest)}" if kind == "resnets" else f"1.{rest}")
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
        i = int(m[1])
        has_attn = "CrossAttn" in cfg["up_block_types"][i]
        return f"output_blocks.{(n + 1) * i + n}.{2 if has_attn else 1}.conv.{m[2]}"
    raise KeyError(key)


def vae_key(key: str, cfg: dict) -> str:
    blocks = len(cfg["block_out_channels"])
    for a in ("quant_conv.", "post_quant_conv."):
        if key.startswith(a):
            return key
    side, _, rest = key.partition(".")
    fixed = {"conv_in.": "conv_in.", "conv_out.": "conv_out.", "conv_norm_out.": "norm_out."}
    for a, b in fixed.items():
        if rest.startswith(a):
            return f"{side}.{b}{rest[len(a):]}"
    if m := re.match(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
        i = int(m[2]) if m[1] == "down" else blocks - 1 - int(m[2])
        return f"{side}.{m[1]}.{i}.block.{m[3]}.{_resnet(m[4], {'conv_shortcut': 'nin_shortcut'})}"
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", rest):
        return f"{side}.down.{m[1]}.downsample.conv.{m[2]}"
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", rest):
        return f"{side}.up.{blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", rest):
        return f"{side}.mid.block_{int(m[1]) + 1}.{_resnet(m[2], {'conv_shortcut': 'nin_shortcut'})}"
    if m := re.match(r"mid_block\.attentions\.0\.(.*)\.(weight|bias)", rest):
        return f"{side}.mid.attn_1.{_VAE_ATTN[m[1]]}.{m[2]}"
    raise KeyError(key)


def write_sd1_single_file(folder: Path, out: Path) -> Path:
    """The diffusers SD1.x pipeline at `folder` as one original-layout .safetensors file."""
    import json

    import safetensors.torch as st

    ckpt = {}
    unet_cfg = json.loads((folder / "unet" / "config.json").read_text())
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text())
    for k, v in st.load_file(folder / "unet" / "diffusion_pytorch_model.safetensors").items():
        ckpt["model.diffusion_model." + unet_key(k, unet_cfg)] = v
    for k, v in st.load_file(folder / "vae" / "diffusion_pytorch_model.safetensors").items():
        name = vae_key(k, vae_cfg)
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # the original VAE attention is 1x1 convolutions
        ckpt["first_stage_model." + name] = v.contiguous()
    for k, v in st.load_file(folder / "text_encoder" / "model.safetensors").items():
        ckpt["cond_stage_model.transformer." + k] = v
    st.save_file(ckpt, out)
    return out


def openclip_keys(hf: dict) -> dict:
    """A transformers CLIPTextModelWithProjection state dict in OpenCLIP's layout (SDXL's second encoder):
    q/k/v fused into in_proj, the projection stored transposed."""
    import torch

    out, qkv = {}, {}
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    fixed = {"text_model.embeddings.position_embedding.weight": "positional_embedding",
             "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
             "text_model.final_layer_norm.weight": "ln_final.weight", "text_model.final_layer_norm.bias": "ln_final.bias"}
    for k, v in hf.items():
        if k in fixed:
            out[fixed[k]] = v
        elif k == "text_projection.weight":
            out["text_projection"] = v.T.contiguous()
        elif m := re.match(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k):
            qkv.setdefault((int(m[1]), m[3]), {})[m[2]] = v
        elif m := re.match(r"text_model\.encoder\.layers\.(\d+)\.(.*)", k):
            rest = m[2]
            for a, b in renames.items():
                rest = rest.replace(a, b)
            out[f"transformer.resblocks.{m[1]}.{rest}"] = v
        elif k != "text_model.embeddings.position_ids":
            raise KeyError(k)
    for (i, kind), parts in qkv.items():
        out[f"transformer.resblocks.{i}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]]).contiguous()
    return out


def write_sdxl_single_file(folder: Path, out: Path) -> Path:
    """The diffusers SDXL pipeline at `folder` as one original (sgm) layout .safetensors file."""
    import json

    import safetensors.torch as st

    ckpt = {}
    unet_cfg = json.loads((folder / "unet" / "config.json").read_text())
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text())
    for k, v in st.load_file(folder / "unet" / "diffusion_pytorch_model.safetensors").items():
        ckpt["model.diffusion_model." + unet_key(k, unet_cfg)] = v
    for k, v in st.load_file(folder / "vae" / "diffusion_pytorch_model.safetensors").items():
        name = vae_key(k, vae_cfg)
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]
        ckpt["first_stage_model." + name] = v.contiguous()
    for k, v in st.load_file(folder / "text_encoder" / "model.safetensors").items():
        ckpt["conditioner.embedders.0.transformer." + k] = v
    for k, v in openclip_keys(st.load_file(folder / "text_encoder_2" / "model.safetensors")).items():
        ckpt["conditioner.embedders.1.model." + k] = v
    st.save_file(ckpt, out)
    return out


def build_tiny_sdxl_widths(folder: Path) -> Path:
    """tests/helpers/family_pipelines.py's tiny SDXL with a wider second text encoder (48 vs 32): diffusers' single-file
    loader tells SDXL's two encoders apart by width (768 vs 1280 in the real model), so equal widths load the
    first encoder's weights into the second."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from family_pipelines import _clip_config, _vae, clip_tokenizer

    torch.manual_seed(0)
    tok1, tok2 = clip_tokenizer(folder / "_tok1"), clip_tokenizer(folder / "_tok2", pad_token="!")
    te1 = CLIPTextModel(_clip_config(tok1, 32))
    te2 = CLIPTextModelWithProjection(_clip_config(tok2, 48, projection_dim=16))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=6 * 8 + 16,
        cross_attention_dim=80, norm_num_groups=8,
    )
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=_vae(), text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2,
                                     unet=unet, scheduler=scheduler, add_watermarker=False)
    pipe.save_pretrained(folder / "diffusers", safe_serialization=True)
    return folder / "diffusers"


def _swap_halves(v):
    """The original MMDiT / Flux final modulation is (shift, scale); diffusers' is (scale, shift)."""
    import torch

    a, b = v.chunk(2, dim=0)
    return torch.cat([b, a], dim=0).contiguous()


_SD3_FIXED = {"pos_embed.pos_embed": "pos_embed", "pos_embed.proj.": "x_embedder.proj.",
              "time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
              "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
              "time_text_embed.text_embedder.linear_1.": "y_embedder.mlp.0.",
              "time_text_embed.text_embedder.linear_2.": "y_embedder.mlp.2.",
              "context_embedder.": "context_embedder.", "proj_out.": "final_layer.linear."}
_SD3_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
              "attn2.to_out.0": "x_block.attn2.proj", "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
              "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
              "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
              "norm1.linear": "x_block.adaLN_modulation.1", "norm1_context.linear": "context_block.adaLN_modulation.1",
              "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
              "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"}
_QKV = {"attn.to_": "x_block.attn.qkv", "attn.add_": "context_block.attn.qkv", "attn2.to_": "x_block.attn2.qkv"}


def sd3_transformer_keys(sd: dict, num_layers: int) -> dict:
    """An SD3Transformer2DModel state dict in the original MMDiT layout (joint_blocks, fused qkv): the inverse of
    diffusers' convert_sd3_transformer_checkpoint_to_diffusers."""
    import torch

    out, qkv = {}, {}
    for k, v in sd.items():
        if k.startswith("norm_out.linear."):
            out["final_layer.adaLN_modulation.1." + k.rsplit(".", 1)[1]] = _swap_halves(v)
            continue
        if fixed := next((a for a in _SD3_FIXED if k.startswith(a)), None):
            out[_SD3_FIXED[fixed] + k[len(fixed):]] = v
            continue
        m = re.match(r"transformer_blocks\.(\d+)\.(.*)\.(weight|bias)$", k)
        i, name, kind = int(m[1]), m[2], m[3]
        if qm := re.match(r"(attn\.to_|attn\.add_|attn2\.to_)([qkv])(?:_proj)?$", name):
            qkv.setdefault((f"joint_blocks.{i}.{_QKV[qm[1]]}.{kind}"), {})[qm[2]] = v
            continue
        if name == "norm1_context.linear" and i == num_layers - 1:  # the last context block: final-layer style
            v = _swap_halves(v)
        out[f"joint_blocks.{i}.{_SD3_BLOCK[name]}.{kind}"] = v
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]]).contiguous()
    return out


def _first_stage(folder: Path, prefix: str) -> dict:
    import json

    import safetensors.torch as st

    cfg = json.loads((folder / "vae" / "config.json").read_text())
    out = {}
    for k, v in st.load_file(folder / "vae" / "diffusion_pytorch_model.safetensors").items():
        name = vae_key(k, cfg)
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # the original VAE attention is 1x1 convolutions
        out[prefix + name] = v.contiguous()
    return out


def write_sd3_single_file(folder: Path, out: Path) -> Path:
    """The diffusers SD3 pipeline at `folder` as one ComfyUI/SAI all-in-one file (sd3_medium_incl_clips_t5xxl's
    layout): model.diffusion_model.*, first_stage_model.*, text_encoders.{clip_l,clip_g,t5xxl}.transformer.*"""
    import json

    import safetensors.torch as st

    layers = json.loads((folder / "transformer" / "config.json").read_text())["num_layers"]
    sd = st.load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    ckpt = {"model.diffusion_model." + k: v for k, v in sd3_transformer_keys(sd, layers).items()}
    ckpt.update(_first_stage(folder, "first_stage_model."))
    for sub, name in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g"), ("text_encoder_3", "t5xxl")):
        for k, v in st.load_file(folder / sub / "model.safetensors").items():
            ckpt[f"text_encoders.{name}.transformer.{k}"] = v
    st.save_file(ckpt, out)
    return out


def build_tiny_sd3_widths(folder: Path) -> Path:
    """tests/helpers/family_pipelines.py's tiny SD3 as diffusers' single-file loader can read it back: CLIP-L and CLIP-G told
    apart by width (32 vs 48, like 768 vs 1280), and CLIP-L's projection the identity (SD3 pools CLIP-L unprojected;
    the loader sets it to torch.eye whatever the file holds)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from family_pipelines import _clip_config, _vae, clip_tokenizer, t5_tokenizer

    torch.manual_seed(0)
    tok1, tok2, tok3 = clip_tokenizer(folder / "_tok1"), clip_tokenizer(folder / "_tok2", pad_token="!"), t5_tokenizer(folder / "_tok3")
    te1 = CLIPTextModelWithProjection(_clip_config(tok1, 32, projection_dim=32))
    with torch.no_grad():
        te1.text_projection.weight.copy_(torch.eye(32))
    te2 = CLIPTextModelWithProjection(_clip_config(tok2, 48, projection_dim=32))
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=80, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                  relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=80, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16, pos_embed_max_size=16,
    )
    vae = _vae(16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                                    text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
                                    text_encoder_3=te3, tokenizer_3=tok3)
    pipe.save_pretrained(folder / "diffusers", safe_serialization=True)
    return folder / "diffusers"


_FLUX_FIXED = {"time_text_embed.timestep_embedder.linear_1.": "time_in.in_layer.",
               "time_text_embed.timestep_embedder.linear_2.": "time_in.out_layer.",
               "time_text_embed.text_embedder.linear_1.": "vector_in.in_layer.",
               "time_text_embed.text_embedder.linear_2.": "vector_in.out_layer.",
               "time_text_embed.guidance_embedder.linear_1.": "guidance_in.in_layer.",
               "time_text_embed.guidance_embedder.linear_2.": "guidance_in.out_layer.",
               "context_embedder.": "txt_in.", "x_embedder.": "img_in.", "proj_out.": "final_layer.linear."}
_FLUX_DOUBLE = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "attn.norm_q": "img_attn.norm.query_norm",
                "attn.norm_k": "img_attn.norm.key_norm", "attn.norm_added_q": "txt_attn.norm.query_norm",
                "attn.norm_added_k": "txt_attn.norm.key_norm", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2", "attn.to_out.0": "img_attn.proj",
                "attn.to_add_out": "txt_attn.proj"}
_FLUX_SINGLE = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
                "proj_out": "linear2"}


def flux_transformer_keys(sd: dict) -> dict:
    """A FluxTransformer2DModel state dict in BFL's original layout (double_blocks / single_blocks, fused qkv and
    linear1 = [q; k; v; mlp]): the inverse of diffusers' convert_flux_transformer_checkpoint_to_diffusers."""
    import torch

    out, fused = {}, {}
    for k, v in sd.items():
        if k.startswith("norm_out.linear."):
            out["final_layer.adaLN_modulation.1." + k.rsplit(".", 1)[1]] = _swap_halves(v)
            continue
        if fixed := next((a for a in _FLUX_FIXED if k.startswith(a)), None):
            out[_FLUX_FIXED[fixed] + k[len(fixed):]] = v
            continue
        m = re.match(r"(single_)?transformer_blocks\.(\d+)\.(.*)\.(weight|bias)$", k)
        single, i, name, kind = bool(m[1]), int(m[2]), m[3], m[4]
        block = f"{'single' if single else 'double'}_blocks.{i}"
        kind = "scale" if name.startswith("attn.norm_") else kind  # RMSNorm weights are `.scale` there
        if qm := re.match(r"attn\.(to_|add_)([qkv])(?:_proj)?$|(proj_mlp)$", name):
            part = qm[2] or "mlp"
            into = "linear1" if single else ("img_attn.qkv" if qm[1] == "to_" else "txt_attn.qkv")
            fused.setdefault(f"{block}.{into}.{kind}", {})[part] = v
            continue
        out[f"{block}.{(_FLUX_SINGLE if single else _FLUX_DOUBLE)[name]}.{kind}"] = v
    for key, parts in fused.items():
        out[key] = torch.cat([parts[p] for p in ("q", "k", "v", "mlp") if p in parts]).contiguous()
    return out


def write_flux_single_file(folder: Path, out: Path) -> Path:
    """The diffusers Flux pipeline at `folder` as one ComfyUI all-in-one file: model.diffusion_model.* (BFL layout),
    vae.*, text_encoders.clip_l.transformer.*, text_encoders.t5xxl.transformer.*"""
    import safetensors.torch as st

    sd = st.load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    ckpt = {"model.diffusion_model." + k: v for k, v in flux_transformer_keys(sd).items()}
    ckpt.update(_first_stage(folder, "vae."))
    for sub, name in (("text_encoder", "clip_l"), ("text_encoder_2", "t5xxl")):
        for k, v in st.load_file(folder / sub / "model.safetensors").items():
            ckpt[f"text_encoders.{name}.transformer.{k}"] = v
    st.save_file(ckpt, out)
    return out
