"""Prompt tokenization with the `tokenizers` library, matching transformers' CLIP and T5 tokenizers.

Both pad to a fixed length and truncate; CLIP wraps the tokens in bos/eos, T5 has no bos and
ends with eos. Which one a tokenizer folder holds is read from its tokenizer_config.json.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..errors import UserError


class PromptTokenizer:
    def __init__(self, folder: Path, max_length: int | None = None):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"tokenizer file missing: {path}")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.max_length = int(max_length or cfg.get("model_max_length", 77))
        t5 = "T5" in str(cfg.get("tokenizer_class", ""))

        def token_id(key: str, default: str | None) -> int | None:
            tok = cfg.get(key, default)
            if isinstance(tok, dict):
                tok = tok.get("content", default)
            if tok is None:
                return None
            i = self._tok.token_to_id(tok)
            if i is None:
                raise UserError(f"{cfg_path}: {key} {tok!r} is not in the vocabulary")
            return i

        self.bos = None if t5 else token_id("bos_token", "<|startoftext|>")
        self.eos = token_id("eos_token", "</s>" if t5 else "<|endoftext|>")
        self.pad = token_id("pad_token", "<pad>" if t5 else "<|endoftext|>")

    def __call__(self, prompts: list[str]) -> np.ndarray:
        """(batch, max_length) int32 ids: [bos,] tokens, eos, then padding; over-long prompts are truncated."""
        out = np.full((len(prompts), self.max_length), self.pad, dtype=np.int32)
        head = [] if self.bos is None else [self.bos]
        room = self.max_length - 1 - len(head)
        for row, prompt in enumerate(prompts):
            ids = self._tok.encode(prompt, add_special_tokens=False).ids
            if len(ids) > room:
                # CLIP marks word ends with </w>; show the dropped words as words
                dropped = self._tok.decode(ids[room:]).replace("</w>", " ").strip()
                warnings.warn(
                    f"prompt truncated to {self.max_length} tokens; dropped: {dropped!r}", UserWarning, stacklevel=3
                )
                ids = ids[:room]
            seq = [*head, *ids, self.eos]
            out[row, : len(seq)] = seq
        return out
