"""Issue 43: the LLM text encoders exported streamed (export/llm_streamed.py) at release size, random bf16 weights.

  python experiments/families/llm_te_export.py build qwen3_4b WORK      # WORK/qwen3_4b/text_encoder: random bf16 shards
  python experiments/families/llm_te_export.py export WORK/qwen3_4b WEIGHTS OUT   # int8 | int4 | float: OUT/model.onnx
  python experiments/families/llm_te_export.py encode OUT [TOKENS]      # one text encode in ORT: seconds, peak RSS
  python experiments/families/llm_te_export.py accuracy WORK/qwen3_4b SCRATCH     # int8/int4 vs fp32 on 2 layers

Each step in its own process, under /usr/bin/time -v for its wall time and peak RSS (see llm_te_export.md).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

# the release configs (config.json values): Z-Image's Qwen3-4B, Qwen-Image's Qwen2.5-VL-7B language model
CONFIGS = {
    "qwen3_4b": ("Qwen3Model", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True), {"layers": (-2,), "positions": "arange"}),
    # the language model of Qwen2_5_VLForConditionalGeneration (Qwen-Image's text encoder); its vision tower and LM
    # head are not written (the text encoder never reads them)
    "qwen25vl_7b": ("Qwen2_5_VLForConditionalGeneration", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=128000, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}), {"layers": (-1,)}),
}


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(name: str, work: Path) -> dict:
    import transformers
    from accelerate import init_empty_weights

    from onnxdiffusion.bench.arch.release import write_random

    cls_name, cfg, _ = CONFIGS[name]
    folder = work / name / "text_encoder"
    if cls_name.startswith("Qwen2_5_VL"):
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31])
        config = transformers.Qwen2_5_VLConfig(text_config=cfg, vision_config=vision, **cfg)
    else:
        config = getattr(transformers, cls_name.replace("Model", "Config"))(**cfg)
    with init_empty_weights():
        meta = getattr(transformers, cls_name)(config)
    meta = getattr(getattr(meta, "model", meta), "language_model", meta)  # the decoder stack only
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)
    t = time.time()
    params = write_random(meta, folder, "model.safetensors", "model.safetensors.index.json", seed=2)
    return {"step": "build", "model": name, "params": params, "seconds": round(time.time() - t, 1), "peak_gb": peak_gb()}


def _spec(name: str):
    from onnxdiffusion.families.base import ComponentSpec, TensorSpec

    _, cfg, options = CONFIGS[name]
    ids = ("batch_size", "sequence_length")
    out = "penultimate_hidden_state" if options.get("layers") == (-2,) else "last_hidden_state"
    return ComponentSpec("text_encoder", (TensorSpec("input_ids", "int64", ids), TensorSpec("attention_mask", "int64", ids)),
                         (TensorSpec(out, "float32", (*ids, cfg["hidden_size"])),), atol=1e-4,
                         kind="decoder_text_encoder", source="text_encoder",
                         options={**options, "rope_axes": 3} if name.startswith("qwen25vl") else options)


def feeds(vocab: int, batch: int, length: int, seed: int) -> dict:
    """Random token ids, the last row right-padded by a third (the mask must matter)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.int64)
    if batch > 1:
        mask[-1, length - length // 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export(folder: Path, weights: str, out: Path) -> dict:
    """The text encoder exported streamed (validated on its first 2 layers), as `export` does it."""
    from onnxdiffusion.export.llm_streamed import build_encoder
    from onnxdiffusion.export.options import ExportOptions
    from onnxdiffusion.export.streamed_backbone import export_streamed
    from onnxdiffusion.export.wrappers import wrap

    name = folder.name
    cls_name, cfg, _ = CONFIGS[name]
    spec = _spec(name)
    t = time.time()
    module = build_encoder(folder / "text_encoder", cls_name, weights)
    built = time.time() - t
    feed_list = [feeds(cfg["vocab_size"], 2, 40, 0), feeds(cfg["vocab_size"], 1, 23, 1)]
    entry = export_streamed(spec, module, lambda m: wrap(spec, m).eval(), feed_list, out, ExportOptions())
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    return {"step": "export", "model": name, "weights": weights, "build_s": round(built, 1),
            "seconds": round(time.time() - t, 1), "peak_gb": round(peak_gb(), 2), "files": files,
            "validation": entry.get("validation")}


def encode(out: Path, tokens: int) -> dict:
    """One text encode of a batch of one `tokens`-token prompt in ORT (session as the run time makes it)."""
    import numpy as np
    import onnxruntime as ort

    t = time.time()
    so = ort.SessionOptions()
    sess = ort.InferenceSession(str(out / "model.onnx"), sess_options=so, providers=["CPUExecutionProvider"])
    load = time.time() - t
    load_gb = peak_gb()
    ids = np.random.default_rng(0).integers(1, 150000, (1, tokens)).astype(np.int64)
    times, cpu = [], []
    for _ in range(3):
        t, c = time.time(), time.process_time()
        y = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
        times.append(round(time.time() - t, 2))
        cpu.append(round(time.process_time() - c, 2))
    return {"step": "encode", "folder": out.name, "tokens": tokens, "load_s": round(load, 1), "load_peak_gb": round(load_gb, 2),
            "encode_s": times, "encode_cpu_s": cpu,
            "threads": os.cpu_count(), "peak_gb": round(peak_gb(), 2), "finite": bool(np.isfinite(y).all()), "shape": list(y.shape)}


def _snr_db(ref, got) -> float:
    import numpy as np

    noise = float(np.square(ref.astype(np.float64) - got).sum())
    return float("inf") if noise == 0 else round(10 * np.log10(float(np.square(ref, dtype=np.float64).sum()) / noise), 2)


def accuracy(folder: Path, scratch: Path, keep: int = 2) -> dict:
    """int8 / int4 on a cut-down copy (the first `keep` layers at the released width, the full embedding table) vs
    PyTorch fp32 over the same bf16 weights: max abs and hidden-state SNR; and the embedding table's own SNR per
    block width (rows drawn at random), which is what chose int8 blocks for it."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from onnxdiffusion.export.gguf_blocks import nbits_to_float
    from onnxdiffusion.export.llm_streamed import build_encoder, quantize
    from onnxdiffusion.export.options import ExportOptions
    from onnxdiffusion.export.safetensors_shards import Shards
    from onnxdiffusion.export.streamed_float import cut_down
    from onnxdiffusion.export.validate import export_component
    from onnxdiffusion.export.wrappers import wrap

    name = folder.name
    cls_name, cfg, _ = CONFIGS[name]
    spec = _spec(name)
    feed = feeds(cfg["vocab_size"], 2, 64, 5)
    np_feed = {k: v.numpy() for k, v in feed.items()}
    small, _ = cut_down(build_encoder(folder / "text_encoder", cls_name, "float"), keep)
    with torch.no_grad():
        ref = wrap(spec, small).eval()(feed["input_ids"], feed["attention_mask"]).numpy()
    small = None
    kept = np_feed["attention_mask"].astype(bool)
    out = {"step": "accuracy", "model": name, "layers": keep, "tokens": int(kept.sum()), "weights": {}}
    for weights in ("int8", "int4"):
        small, _ = cut_down(build_encoder(folder / "text_encoder", cls_name, weights), keep)
        t = time.time()
        entry = export_component(spec, wrap(spec, small).eval(), [feed], scratch / weights, ExportOptions())
        small = None
        sess = ort.InferenceSession(str(scratch / weights / "model.onnx"), providers=["CPUExecutionProvider"])
        got = sess.run(None, np_feed)[0]
        out["weights"][weights] = {
            "vs_fp32_max_abs": float(np.abs(ref - got)[kept].max()), "ref_max_abs": float(np.abs(ref[kept]).max()),
            "hidden_snr_db": _snr_db(ref[kept], got[kept]),
            "vs_own_dequantized_max_abs": entry["validation"]["max_abs_error"], "seconds": round(time.time() - t, 1)}
        sess = None
    shards = Shards(folder / "text_encoder")
    table = next(n for n in shards.entries if n.endswith("embed_tokens.weight"))
    rows = np.sort(np.random.default_rng(0).choice(cfg["vocab_size"], 2048, replace=False))
    w = np.stack([shards.read(table, (int(r), int(r) + 1))[0] for r in rows])
    out["embedding_snr_db"] = {f"int{b}": _snr_db(w, nbits_to_float(quantize(w, b), w.shape)) for b in (8, 4)}
    out["peak_gb"] = round(peak_gb(), 2)
    return out


def collect(work: Path, out: Path) -> dict:
    """Every step's JSON line and /usr/bin/time -v figures from WORK/*.log into one results file (no machine paths)."""
    import platform
    import re

    keys = {"Elapsed (wall clock) time (h:mm:ss or m:ss)": "wall", "Maximum resident set size (kbytes)": "max_rss_kb",
            "User time (seconds)": "user_s", "System time (seconds)": "sys_s"}
    runs = {}
    for log in sorted(work.glob("*.log")):
        text = log.read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith("{")), None)
        rec = json.loads(line) if line else {"failed": text.strip().splitlines()[-1:]}
        for key, short in keys.items():
            m = re.search(re.escape(key) + r": (\S+)", text)
            if m:
                rec[short] = m.group(1)
        if "max_rss_kb" in rec:
            rec["max_rss_gb"] = round(int(rec.pop("max_rss_kb")) / 2**20, 2)
        runs[log.stem] = rec
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    result = {"cpu": cpu, "vcpus": os.cpu_count(), "runs": runs,
              "commands": "python experiments/families/llm_te_export.py {build,export,encode,accuracy} ... under "
                          "/usr/bin/time -v, WORK a scratch folder (see llm_te_export.md)"}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return {"step": "collect", "runs": len(runs)}


if __name__ == "__main__":
    step = sys.argv[1]
    if step == "build":
        out = build(sys.argv[2], Path(sys.argv[3]))
    elif step == "export":
        out = export(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    elif step == "accuracy":
        out = accuracy(Path(sys.argv[2]), Path(sys.argv[3]))
    elif step == "collect":
        out = collect(Path(sys.argv[2]), Path(sys.argv[3]))
    elif step == "encode":
        out = encode(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64)
    else:
        raise SystemExit(__doc__)
    print(json.dumps(out))
