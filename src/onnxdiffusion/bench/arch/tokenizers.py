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


def clip_tokenizer(folder: Path, words: list[str], model_max_length: int, pad_token: str | None = None):
    """build_tokenizer_files into `folder`, optionally with another pad token (SDXL's second tokenizer
    pads with "!"), loaded as a CLIPTokenizer."""
    from transformers import CLIPTokenizer

    build_tokenizer_files(words, folder, model_max_length)
    if pad_token is not None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            cfg = json.loads((folder / name).read_text())
            cfg["pad_token"] = pad_token
            (folder / name).write_text(json.dumps(cfg))
    return CLIPTokenizer.from_pretrained(folder)


def t5_tokenizer(folder: Path, words: list[str], max_length: int):
    """A T5 (Unigram) tokenizer over `words` built with the `tokenizers` library: <pad>=0, </s>=1, <unk>=2;
    saved into `folder` and loaded back as a T5TokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = sorted(set(words))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0 - i * 1e-3) for i, w in enumerate(words)]
    vocab += [(ch, -20.0) for ch in "abcdefghijklmnopqrstuvwxyz0123456789,.!?"] + [("\u2581", -15.0)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           model_max_length=max_length, extra_ids=0)
    fast.save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)
