"""The feeds of a `--whole` sampling graph for a host run (tests/loopgraph/test_whole.py, experiments/families/whole_llm.py):
token ids and, for an LLM encoder, their attention masks; the pipeline's table and size conditioning."""

from __future__ import annotations

import numpy as np


def whole_feeds(sess, pipe, host, prompts, negative, steps: int, guidance: float, sampler: str) -> dict:
    """The whole graph's feeds for `host`'s run: the tokenizers' ids and masks (prompt and negative each padded to
    its own longest: the graph pads them alike), the pipeline's table and size conditioning."""
    from onnxdiffusion.runtime.pipeline import GenerateOptions

    sess_inputs = {i.name for i in sess.get_inputs()}
    batch, (h, w) = len(prompts), host.images.shape[1:3]
    table = pipe.table(GenerateOptions(steps=steps, height=h, width=w, sampler=sampler))
    fam = pipe.family
    embedded = fam.guidance_input_for(pipe.info)
    scale = guidance if embedded is not None else fam.cfg_scale(guidance)
    feeds = {"latents": host.init_latents, "table": table.rows, "init_scale": np.array(table.init_scale, np.float32),
             "guidance": np.array(max(scale, 1.0), np.float32), "noise": np.zeros((1, *host.init_latents.shape), np.float32)}
    if "steps" in sess_inputs:  # the Loop form (an unrolled graph runs its own count)
        feeds["steps"] = np.array(steps, np.int64)
    feeds["input_ids"], feeds["attention_mask"] = pipe.tokenizers["text_encoder"](prompts)
    if "uncond_input_ids" in sess_inputs:
        feeds["uncond_input_ids"], feeds["uncond_attention_mask"] = pipe.tokenizers["text_encoder"]([negative] * batch)
    size = fam.size_conditioning(pipe.info, batch, h, w)
    if embedded is not None:
        size[embedded] = np.full((batch,), guidance, np.float32)
    for key, value in size.items():
        for side in ("cond_", "uncond_"):
            if side + key in sess_inputs:
                feeds[side + key] = value
    if "grid_rows" in sess_inputs:
        f = 2 * int(pipe.info.vae_scale_factor)
        feeds["grid_rows"], feeds["grid_cols"] = np.array(h // f, np.int64), np.array(w // f, np.int64)
    assert sess_inputs <= set(feeds) | {"start", "image_latents", "image_scale", "keep", "blend"}
    return feeds
