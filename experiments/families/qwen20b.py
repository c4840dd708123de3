#!/usr/bin/env python
"""Qwen-Image at release size (20 B backbone) from a Q4_0 GGUF: exported and one 512x512 image generated on a 24 GB
CPU machine (issue 43, acceptance 2's second half). Random weights; nothing materializes the fp32 model.

    W=work folder (~25 GB free)
    python -m onnxdiffusion.bench.arch.fullwidth build qwenimage W/base --profile memory --depth 1
    python experiments/families/qwen20b.py base W/base                 # the backbone config at 60 blocks
    python experiments/families/qwen20b.py gguf W/base W/q4_0.gguf      # random Q4_0 blocks, tensor by tensor
    /usr/bin/time -v onnxdiffusion export W/q4_0.gguf W/qwen20b --base W/base --skip vae_encoder
    /usr/bin/time -v python experiments/families/fullsize_run.py W/qwen20b --modes bounded --size 512 --steps 2

`base`: fullwidth.py's Qwen-Image folder (text encoder at Qwen2.5-VL-7B's width, one layer; the release VAE;
the release scheduler; a scene-word tokenizer) with its backbone's config.json set to the released 60 blocks and
its backbone weights removed (a GGUF export reads the config only).
`gguf`: every tensor of the 60-block QwenImageTransformer2DModel under diffusers' names (as city96's files hold
them, architecture `qwen_image`); 2-D weights Q4_0 (random nibbles, one fp16 scale per 32 giving weights of std
~0.02), 1-D tensors F32 (norm weights 1, biases 0). Written in one pass, one tensor in memory at a time.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

LAYERS = 60
STD = 0.02
# Q4_0: value = scale * (nibble - 8); uniform nibbles in 0..15 give (nibble - 8) a std of sqrt((16**2 - 1) / 12)
SCALE = np.float16(STD / np.sqrt((16 ** 2 - 1) / 12))


def base(folder: Path) -> None:
    """The base folder's backbone config at LAYERS blocks; its (shallow) backbone weights dropped."""
    cfg_path = folder / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_layers"] = LAYERS
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    for f in (folder / "transformer").iterdir():
        if f.name != "config.json":
            f.unlink()
    desc_path = folder / "fullwidth.json"
    desc = json.loads(desc_path.read_text())
    desc.update(backbone_depth=LAYERS, backbone_config=cfg, note="backbone weights in a GGUF file (qwen20b.py)")
    desc_path.write_text(json.dumps(desc, indent=1) + "\n")


def _shapes(folder: Path) -> list[tuple[str, tuple[int, ...]]]:
    from onnxdiffusion.export.streamed_float import empty_backbone

    module = empty_backbone(folder / "transformer", "QwenImageTransformer2DModel")
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


def _q4_0(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    n, k = shape
    blocks = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(SCALE.tobytes(), np.uint8)
    return blocks.reshape(n, -1)


def gguf_file(folder: Path, out: Path) -> dict:
    import gguf

    shapes = _shapes(folder)
    writer = gguf.GGUFWriter(str(out), "qwen_image")
    plan = []
    for name, shape in shapes:
        if len(shape) == 2 and shape[1] % 32 == 0:
            nbytes = shape[0] * shape[1] // 32 * 18
            writer.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            plan.append((name, shape, "Q4_0"))
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            plan.append((name, shape, "F32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    t0 = time.time()
    for i, (name, shape, kind) in enumerate(plan):
        if kind == "Q4_0":
            a = _q4_0(shape, rng)
        elif name.endswith(".weight") and "norm" in name:
            a = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            a = np.zeros(shape, np.float32)
        else:
            a = (rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float32)
        writer.write_tensor_data(a)
        if i % 100 == 0:
            print(f"{i}/{len(plan)} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    writer.close()
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    return {"tensors": len(plan), "q4_0": sum(k == "Q4_0" for *_, k in plan), "params": params,
            "fp32_bytes": 4 * params, "gguf_bytes": out.stat().st_size, "write_s": round(time.time() - t0, 1)}


def main() -> None:
    verb, *args = sys.argv[1:]
    if verb == "base":
        base(Path(args[0]))
    elif verb == "gguf":
        print(json.dumps(gguf_file(Path(args[0]), Path(args[1]))))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
