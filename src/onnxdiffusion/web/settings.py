"""The page's settings as data: sampler tables for every step count, the latent shape, the tokenizers' ids.

Every number comes from the Python pipeline itself (`Pipeline.table`, `latent_shape`, its tokenizers), so the
page feeds the whole graph exactly what `generate --loop loop` would. The tables travel as one little-endian
float32 file (tables.bin); settings.json says where each (sampler, steps) block starts.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..samplers import COLUMNS
from ..samplers.tables import samplers_for


def sampler_tables(pipe, max_steps: int, samplers: list[str] | None = None) -> tuple[dict, np.ndarray]:
    """({sampler: {"tables": {steps: {offset, rows, init_scale, needs_noise}}}}, the float32 rows, flat)."""
    from ..runtime.generation import GenerateOptions

    names = samplers or list(samplers_for(pipe.schedule))
    out, blocks, offset = {}, [], 0
    for name in names:
        tables = {}
        for n in range(1, max_steps + 1):
            try:
                t = pipe.table(GenerateOptions(steps=n, sampler=name))
            except UserError:
                if samplers:  # asked for by name: say why not
                    raise
                continue  # this sampler cannot run n steps (the page says so when asked)
            rows = np.ascontiguousarray(t.rows, dtype="<f4")
            if rows.shape[1] != len(COLUMNS):  # multistep history columns (PNDM, UniPC): host loop only
                if samplers:
                    raise UserError(f"sampler {name} runs in the host loop only (its table has history columns); "
                                    "the page runs the Loop graph")
                break
            tables[str(n)] = {"offset": offset, "rows": int(rows.shape[0]), "init_scale": float(t.init_scale),
                              "needs_noise": bool(t.needs_noise)}
            blocks.append(rows.reshape(-1))
            offset += rows.size
        if tables:
            out[name] = {"tables": tables}
    if not out:
        raise UserError("no sampler of this model can run on the page")
    return out, np.concatenate(blocks)


def text_inputs(pipe, graph_inputs: dict) -> list[dict]:
    """One entry per text encoder the whole graph takes ids for: input names, ids, length, tokenizer files.
    `graph_inputs`: the whole graph's inputs by name (their ONNX element type). An LLM encoder's entry
    (its graph takes an attention mask beside the ids) carries the tokenizer's `chat` spec: the rendered chat
    template around the prompt, special tokens, truncation and padding, as its PaddedTokenizer applies them."""
    out = []
    for slot in pipe.slots:
        tok = pipe.tokenizers[slot.name]
        suffix = slot.name[len("text_encoder"):]
        ids, uncond = f"input_ids{suffix}", f"uncond_input_ids{suffix}"
        if ids not in graph_inputs:
            raise UserError(f"the whole graph has no {ids!r} input for {slot.name}")
        entry = {"encoder": slot.name, "input": ids, "uncond_input": uncond if uncond in graph_inputs else None,
                 "tokenizer": f"{slot.tokenizer}/tokenizer.json", "config": f"{slot.tokenizer}/tokenizer_config.json"}
        mask = f"attention_mask{suffix}"
        if mask in graph_inputs:
            if not hasattr(tok, "page_spec"):
                raise UserError(f"the page cannot tokenize for {slot.name} of {pipe.family.name} folders yet")
            chat = tok.page_spec()
            entry |= {"mask_input": mask, "uncond_mask_input": f"uncond_{mask}" if entry["uncond_input"] else None,
                      "dtype": _INT_TYPES[graph_inputs[ids]], "chat": chat,
                      "max_length": chat["pad_to"] or chat["truncate"], "bos": None, "eos": None, "pad": chat["pad"]}
        else:
            entry |= {"dtype": "int32", "max_length": tok.max_length, "bos": tok.bos, "eos": tok.eos, "pad": tok.pad}
        out.append(entry)
    return out


_INT_TYPES = {6: "int32", 7: "int64"}  # onnx.TensorProto.INT32 / INT64: the ids' element type in the graph


def guidance_scale(pipe) -> list[float]:
    """[a, b]: the graph's guidance input is a * guidance + b, as the Loop form feeds it (run_loop.py: the family's
    cfg_scale unless the backbone embeds the guidance)."""
    if pipe.family.guidance_input_for(pipe.info) is not None:
        return [1.0, 0.0]
    b = float(pipe.family.cfg_scale(0.0))
    a = float(pipe.family.cfg_scale(1.0)) - b
    if abs(pipe.family.cfg_scale(7.25) - (a * 7.25 + b)) > 1e-9:
        raise UserError(f"the page cannot run {pipe.family.name} folders yet: their guidance scale is not affine")
    return [a, b]


def size_feeds(pipe, height: int, width: int) -> dict[str, np.ndarray]:
    """The whole graph's inputs fixed by the page's one image size (not by prompt or seed), as generate's Loop
    form feeds them: the family's size conditioning (a packed family's image token ids, FLUX.2's empty reference
    inputs) on both halves of the guidance batch, and the token grid the graph unpacks before the VAE."""
    feeds = {}
    for key, value in pipe.family.size_conditioning(pipe.info, 1, height, width).items():
        feeds[f"cond_{key}"] = feeds[f"uncond_{key}"] = value
    if pipe.family.latent_patch:
        f = int(pipe.info.vae_scale_factor) * int(pipe.family.latent_patch)
        feeds["grid_rows"], feeds["grid_cols"] = np.array(height // f, np.int64), np.array(width // f, np.int64)
    return feeds
