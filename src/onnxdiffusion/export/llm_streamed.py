"""An LLM text encoder (export/llm_text_encoder.py) exported with its weights streamed from the safetensors shards
(issue 43: export bounded by memory; Z-Image's Qwen3-4B is 15.7 GB in fp32, Qwen-Image's Qwen2.5-VL-7B ~30 GB).

The transformers model is built from its config with no weights (accelerate's empty init) and only its decoder stack
is given any: each nn.Linear becomes a layer that holds no weight (streamed_float.FloatLinear for float weights,
gguf_linear.NBitsLinear for int8/int4 ones, its blocks quantized from the shard's tensor when the layer is written),
the token embedding table likewise (a Gather, or ORT's GatherBlockQuantized over int8 blocks), and the norms and
biases (a few MB) are read as fp32. The graph is traced over placeholders and every weight is then laid into the
external-data file one layer at a time by the writers the backbones use, so the peak is one layer plus the exporter,
not the model. The rest of a vision-language model (the vision tower) stays on the meta device: the text encoder
never runs it. Validation runs on a cut-down copy (the first layers at the released width), as a streamed backbone's.

Weights (ExportOptions.text_encoder_weights):
  float  fp32 MatMul weights and embedding, what the plain export writes (bf16 shards widened exactly);
  int8   MatMulNBits 8-bit blocks of 32 with an fp32 scale each, accuracy_level 4 (int8 activations: ORT's fast
         CPU path), and the embedding table as GatherBlockQuantized int8 blocks of 32;
  int4   the same with 4-bit Linear blocks (symmetric, zero point 8); the embedding stays int8 blocks (measured
         in experiments/families/llm_te_export.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .gguf_blocks import BLOCK, NBits, requantize4, requantize8
from .gguf_linear import NBitsLinear
from .llm_text_encoder import decoder_stack
from .safetensors_shards import Shards
from .streamed_float import EMBEDDING_FLAG, FloatLinear, gather_op, parent_of

WEIGHTS = ("float", "int8", "int4")
# the table's blocks under int8 and int4 weights alike: int4 blocks would save 0.2 GB of Qwen3-4B's table and cost
# 24 dB of its SNR (45.4 -> 21.3 dB, experiments/families/llm_te_export.md)
EMBEDDING_BITS = 8
GBQ_OP = "com.microsoft::GatherBlockQuantized"


def precision(weights: str) -> dict:
    """What the manifest records of a text encoder exported with `weights`."""
    if weights == "float":
        return {"linear": "fp32", "embedding": "fp32"}
    return {"linear": f"{weights} (MatMulNBits, blocks of {BLOCK}, accuracy_level 4)",
            "embedding": f"int{EMBEDDING_BITS} (GatherBlockQuantized, blocks of {BLOCK})"}


CHUNK_ROWS = 8192  # an embedding table quantized this many rows at a time: 151936 x 3584 whole would be GBs of scratch


def quantize(w: np.ndarray, bits: int) -> NBits:
    return requantize8(w) if bits == 8 else requantize4(w)


def quantize_table(shards: Shards, name: str, bits: int) -> NBits:
    """A [V, D] table's rows as blocks (the same as quantize() of the whole: blocks never cross a row), read and
    quantized CHUNK_ROWS at a time; b [V, D * bits / 8] and scales [V, D / 32], GatherBlockQuantized's layout."""
    vocab, width = shards.entries[name].shape
    b = np.empty((vocab, width * bits // 8), np.uint8)
    scales = np.empty((vocab, width // BLOCK), np.float32)
    for start in range(0, vocab, CHUNK_ROWS):
        nb = quantize(shards.read(name, (start, start + CHUNK_ROWS)), bits)
        stop = start + len(nb.scales) // (width // BLOCK)
        b[start:stop], scales[start:stop] = nb.b.reshape(stop - start, -1), nb.scales.reshape(stop - start, -1)
    return NBits(b, scales, bits, False, None)


class _GatherBlockQuantized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, data, scales, n: int, k: int, bits: int):
        return torch.zeros((*ids.shape, k), dtype=torch.float32)  # traced over placeholders: only the shape matters

    @staticmethod
    def symbolic(g, ids, data, scales, n: int, k: int, bits: int):
        y = g.op(GBQ_OP, data, ids, scales, gather_axis_i=0, quantize_axis_i=1, block_size_i=BLOCK, bits_i=bits)
        sizes = ids.type().varyingSizes()
        if sizes is not None:
            y.setType(ids.type().with_sizes([*sizes, k]).with_dtype(torch.float32))
        return y


def _rows(shards: Shards, name: str, ids: torch.Tensor) -> np.ndarray:
    """The table's rows for `ids` ([..., D] float32), each read alone: an eager forward never reads the table."""
    flat = ids.reshape(-1).tolist()
    return np.stack([shards.read(name, (i, i + 1))[0] for i in flat]).reshape(*ids.shape, -1)


class NBitsEmbedding(NBitsLinear):
    """nn.Embedding over int8 blocks of its table's rows (the same placeholders and writer as an NBitsLinear's):
    GatherBlockQuantized in ONNX; in PyTorch the rows asked for, quantized alike and dequantized."""

    def __init__(self, shards: Shards, name: str, bits: int, index: int):
        vocab, width = shards.entries[name].shape
        super().__init__(lambda: quantize_table(shards, name, bits), bits, index, vocab, width, None)
        self.rows = lambda ids: _rows(shards, name, ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return _GatherBlockQuantized.apply(ids, self.qweight, self.scales, self.out_features, self.in_features,
                                               self.bits)
        from .gguf_blocks import nbits_to_float

        w = self.rows(ids).reshape(-1, self.in_features)
        rows = nbits_to_float(quantize(w, self.bits), w.shape)
        return torch.from_numpy(rows).reshape(*ids.shape, self.in_features)


class FloatEmbedding(FloatLinear):
    """nn.Embedding over a table left in the shards: a Gather in ONNX (written untransposed)."""

    def __init__(self, shards: Shards, name: str, index: int):
        vocab, width = shards.entries[name].shape
        super().__init__(lambda: shards.read(name), index, vocab, width, None, EMBEDDING_FLAG)
        self.rows = lambda ids: _rows(shards, name, ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return gather_op(ids, self.placeholder, self.in_features)
        return torch.from_numpy(self.rows(ids))


def _empty_model(folder: Path, class_name: str):
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise UserError(f"{folder}: component class {class_name!r} is not available in this transformers")
    try:
        config = cls.config_class.from_pretrained(str(folder), local_files_only=True)
        with init_empty_weights():
            return cls._from_config(config, dtype=torch.float32)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{folder}: cannot build a {class_name} from its config.json: "
                        f"{str(e).splitlines()[0][:200]}") from None


def _prefix(shards: Shards, stack_names: set[str]) -> str:
    """The shards' prefix of the decoder stack's tensors ("", "model.", "model.language_model.", ...): checkpoints
    name the stack by where their writer's class held it, not where this transformers holds it."""
    found = sorted({n[:-len("embed_tokens.weight")] for n in shards.entries if n.endswith("embed_tokens.weight")},
                   key=len)
    for prefix in found:
        if all(prefix + n in shards.entries for n in stack_names):
            return prefix
    raise UserError(f"{shards.folder}: no prefix under which the shards hold the decoder stack's "
                    f"{len(stack_names)} tensors (embed_tokens.weight under {found or 'no name'})")


def _loader(shards: Shards, name: str, bits: int | None) -> Callable:
    if bits is None:
        return lambda: shards.read(name)
    return lambda: quantize(shards.read(name), bits)


def build_encoder(folder: Path, class_name: str, weights: str):
    """The transformers `class_name` of `folder` with its decoder stack's Linear weights and embedding table left in
    the shards (read, and quantized for int8/int4, one layer at a time when written), the rest of the stack in fp32."""
    if weights not in WEIGHTS:
        raise UserError(f"text encoder weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    shards = Shards(folder)
    module = _empty_model(folder, class_name)
    stack = decoder_stack(module)
    params = dict(stack.named_parameters())
    prefix = _prefix(shards, set(params))
    for name, p in params.items():
        if tuple(p.shape) != shards.entries[prefix + name].shape:
            raise UserError(f"{folder}: tensor {prefix + name!r} has shape {list(shards.entries[prefix + name].shape)}; "
                            f"the config wants {list(p.shape)}")
    bits = None if weights == "float" else int(weights[3:])
    linears = [(n, m) for n, m in stack.named_modules() if type(m) is torch.nn.Linear]
    done: set[str] = set()
    for index, (name, lin) in enumerate(linears):
        if bits is not None and lin.in_features % BLOCK:
            raise UserError(f"{folder}: {name} has {lin.in_features} inputs, not a multiple of {BLOCK}: "
                            f"{weights} blocks cannot hold it")
        bias = torch.from_numpy(shards.read(f"{prefix}{name}.bias")) if lin.bias is not None else None
        load = _loader(shards, f"{prefix}{name}.weight", bits)
        layer = (FloatLinear(load, index, lin.out_features, lin.in_features, bias) if bits is None else
                 NBitsLinear(load, bits, index, lin.out_features, lin.in_features, bias))
        owner, leaf = parent_of(stack, name)
        setattr(owner, leaf, layer)
        done.update({f"{name}.weight", f"{name}.bias"})
    table = stack.get_input_embeddings()
    emb_name = next(n for n, m in stack.named_modules() if m is table)
    table_name = f"{prefix}{emb_name}.weight"
    if bits is not None and table.weight.shape[1] % BLOCK:
        raise UserError(f"{folder}: the embedding's width {table.weight.shape[1]} is not a multiple of {BLOCK}")
    stack.set_input_embeddings(FloatEmbedding(shards, table_name, len(linears)) if bits is None else
                               NBitsEmbedding(shards, table_name, EMBEDDING_BITS, len(linears)))
    done.add(f"{emb_name}.weight")
    for name in params:
        if name not in done:
            owner, leaf = parent_of(stack, name)
            setattr(owner, leaf, torch.nn.Parameter(torch.from_numpy(shards.read(prefix + name)), requires_grad=False))
    return module.eval()


def streams(module) -> bool:
    """Whether `module` is an encoder build_encoder made (its weights wait in the shards)."""
    return any(isinstance(m, (FloatEmbedding, NBitsEmbedding)) for m in module.modules())


def wanted(folder: Path, options) -> bool:
    """Whether the LLM text encoder in `folder` is exported streamed: int8/int4 weights always, float ones as
    --stream-weights says for the backbone ("auto": above STREAM_ABOVE of fp32 weights). A LoRA merged into the
    weights or run-time LoRA points need the whole module (float only)."""
    from .streamed_float import should_stream

    weights = options.text_encoder_weights
    if weights not in WEIGHTS:
        raise UserError(f"--text-encoder-weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if options.loras or options.lora_points:
        if weights != "float":
            raise UserError(f"--text-encoder-weights {weights} cannot be combined with --lora or --lora-points "
                            "(they need the float text encoder)")
        return False
    return weights != "float" or should_stream(folder, options.stream_weights)


def record(entry: dict, weights: str) -> None:
    """The manifest's account of a streamed text encoder (its component entry)."""
    entry["streamed_weights"] = True
    entry["precision"] = "fp32" if weights == "float" else weights
    entry["weights"] = precision(weights)


def cut_copy(module, options: dict, keep: int) -> tuple[object, dict]:
    """The cut-down copy a streamed encoder validates on: its first `keep` layers (streamed_float.cut_down), or, when
    the encoder reads several hidden layers (FLUX.2 [klein]: 9, 18, 27), every layer kept with the first `keep`
    layers' modules repeated in turn, so the reads exist while only `keep` layers' weights are ever loaded."""
    import copy

    from .streamed_float import cut_down

    if len(options.get("layers", (-1,))) < 2:
        return cut_down(module, keep)
    small = copy.deepcopy(module)
    stack = decoder_stack(small)
    n = len(stack.layers)
    stack.layers = torch.nn.ModuleList([stack.layers[i % keep] for i in range(n)])
    return small, {"layers": f"{n} kept, the first {keep} layers' weights repeated"}
