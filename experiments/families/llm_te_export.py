"""Issue 43: the LLM text encoders exported streamed (export/llm_streamed.py) at release size, random bf16 weights.

  python experiments/families/llm_te_export.py build qwen3_4b WORK      # WORK/qwen3_4b/text_encoder: random bf16 shards
  python experiments/families/llm_te_export.py export WORK/qwen3_4b WEIGHTS OUT   # int8 | int4 | float: OUT/model.onnx
  python experiments/families/llm_te_export.py encode OUT [TOKENS]      # one text encode in ORT: seconds, peak RSS

Each step in its own process, under /usr/bin/time -v for its wall time and peak RSS (see llm_te_export.md).
"""

from __future__ import annotations

import json
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
    "qwen25vl_7b": ("Qwen2Model", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                       max_position_embeddings=128000, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False), {"layers": (-1,)}),
}


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(name: str, work: Path) -> dict:
    import transformers
    from accelerate import init_empty_weights

    from onnxdiffusion.bench.arch.release import write_random

    cls_name, cfg, _ = CONFIGS[name]
    folder = work / name / "text_encoder"
    config = getattr(transformers, cls_name.replace("Model", "Config"))(**cfg)
    with init_empty_weights():
        meta = getattr(transformers, cls_name)(config)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)
    t = time.time()
    params = write_random(meta, folder, "model.safetensors", "model.safetensors.index.json", seed=2)
    return {"step": "build", "model": name, "params": params, "seconds": round(time.time() - t, 1), "peak_gb": peak_gb()}


if __name__ == "__main__":
    step = sys.argv[1]
    if step == "build":
        out = build(sys.argv[2], Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
    print(json.dumps(out))
