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


def text_inputs(pipe, graph_inputs: set[str]) -> list[dict]:
    """One entry per text encoder the whole graph takes ids for: input names, ids, length, tokenizer files."""
    out = []
    for slot in pipe.slots:
        tok = pipe.tokenizers[slot.name]
        suffix = slot.name[len("text_encoder"):]
        ids, uncond = f"input_ids{suffix}", f"uncond_input_ids{suffix}"
        if ids not in graph_inputs:
            raise UserError(f"the whole graph has no {ids!r} input for {slot.name}")
        out.append({"encoder": slot.name, "input": ids, "uncond_input": uncond if uncond in graph_inputs else None,
                    "max_length": tok.max_length, "bos": tok.bos, "eos": tok.eos, "pad": tok.pad,
                    "tokenizer": f"{slot.tokenizer}/tokenizer.json", "config": f"{slot.tokenizer}/tokenizer_config.json"})
    return out
