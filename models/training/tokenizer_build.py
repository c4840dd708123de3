"""Build a CLIPTokenizer whose vocabulary gives every caption word a single token.

CLIP's byte-level BPE needs the 256 byte symbols (alone and word-final) plus merges; we add
merges that assemble each caption word left to right, so unseen words still tokenize, by bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers.models.clip.tokenization_clip import bytes_to_unicode


def build_tokenizer_files(words: list[str], out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    base = list(bytes_to_unicode().values())
    vocab_tokens = base + [b + "</w>" for b in base]
    merges: list[tuple[str, str]] = []
    seen = set(vocab_tokens)
    for word in sorted(set(words) | {","}):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            merged = pair[0] + pair[1]
            if pair not in merges:
                merges.append(pair)
            if merged not in seen:
                vocab_tokens.append(merged)
                seen.add(merged)
            symbols = [merged] + symbols[2:]
    vocab_tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(vocab_tokens)}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (out_dir / "merges.txt").write_text("\n".join(lines) + "\n")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": model_max_length,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "do_lower_case": True,
        "errors": "replace",
        "add_prefix_space": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
