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
        try:
            self._tok = Tokenizer.from_file(str(path))
        except BaseException as e:  # its own Exception subclasses, and a Rust panic (pyo3's PanicException is a
            # BaseException) on some crafted files (fuzz seed 1763): both are a bad file, not our crash
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or type(e).__name__ not in ("PanicException",) \
                    and not isinstance(e, Exception):
                raise
            raise UserError(f"{path}: not a usable tokenizer file ({' '.join(str(e).split())[:200]})") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg_path = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_bytes().decode("utf-8")) if cfg_path.is_file() else {}
        except (ValueError, RecursionError) as e:
            raise UserError(f"{cfg_path} is not valid JSON: {str(e).splitlines()[0][:200]}") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{cfg_path} must hold a JSON object")
        n = max_length or cfg.get("model_max_length", 77)
        # transformers writes a huge sentinel for "no limit"; CLIP text encoders take 77 positions
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not 3 <= n:
            raise UserError(f"{cfg_path}: model_max_length must be an integer >= 3, got {n!r}")
        self.max_length = int(min(n, 1 << 16))
        t5 = "T5" in str(cfg.get("tokenizer_class", ""))

        def token_id(key: str, default: str | None) -> int | None:
            tok = cfg.get(key, default)
            if isinstance(tok, dict):
                tok = tok.get("content", default)
            if tok is None:
                return None
            if not isinstance(tok, str):
                raise UserError(f"{cfg_path}: {key} must be a string, got {tok!r}")
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


class PaddedTokenizer:
    """A `tokenizer.json` tokenizer that pads and truncates through the `tokenizers` library itself,
    as transformers' fast tokenizers do, returning an attention mask too: Qwen2 (a prompt template,
    padded to the longest prompt)."""

    def __init__(self, folder: Path, max_length: int | None, template: str = "{}", special_tokens: bool = True):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"tokenizer file missing: {path}")
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        pad = cfg.get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        pad_id = self._tok.token_to_id(pad) if pad else None
        if pad_id is None:
            raise UserError(f"{cfg_path}: pad_token {pad!r} is not in the vocabulary")
        if cfg.get("padding_side", "right") != "right":
            raise UserError(f"{cfg_path}: padding_side {cfg.get('padding_side')!r} is not supported (right only)")
        self.max_length, self.template = max_length, template
        self._tok.no_truncation()
        self._tok.no_padding()
        self._pad_id, self._pad = pad_id, pad
        self._special = special_tokens  # False: the template already holds them (a rendered chat template's BOS)

    def page_spec(self, pad_to_max: bool, truncate_to: int | None = None, strip: tuple[str, ...] = ()) -> dict:
        """What the browser page (web/page/prompt.js) needs to tokenize as __call__(prompts, pad_to_max,
        truncate_to) does for one prompt: the template around it, special tokens, truncation, padding."""
        head, tail = self.template.format("\0").split("\0")
        return {"head": head, "tail": tail, "special_tokens": self._special, "truncate": truncate_to,
                "pad_to": self.max_length if pad_to_max else None, "pad": self._pad_id, "strip": list(strip)}

    def __call__(self, prompts: list[str], pad_to_max: bool, truncate_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), both (batch, length) int64."""
        self._tok.no_truncation()
        if truncate_to is not None:
            self._tok.enable_truncation(truncate_to)
        length = self.max_length if pad_to_max else None
        self._tok.enable_padding(pad_id=self._pad_id, pad_token=self._pad, length=length)
        enc = self._tok.encode_batch([self.template.format(p) for p in prompts], add_special_tokens=self._special)
        self._tok.no_padding()
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return ids, mask
