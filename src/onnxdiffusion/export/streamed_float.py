"""A float backbone exported with its weights streamed from the safetensors shards (issue 43: export bounded by
memory, not by model size).

The backbone is built from its config without weights (accelerate's empty init). Each nn.Linear becomes a
FloatLinear that holds no weight: in PyTorch it reads its weight from the shards when a forward needs it (one layer
at a time), and the graph is traced over 16-byte placeholders in a private op; `write_streamed` then turns each
placeholder into the weight (transposed, fp32, what the plain export's folded MatMul weight holds) written into
`model.onnx_data` one layer at a time, and the op into a plain MatMul. Every other parameter (norms, biases,
embeddings, convolutions: a small share of a DiT) is read into memory as fp32.

Validation stays bounded: ONNX Runtime running the whole backbone pages in every weight (1x the fp32 bytes), so the
numerical comparison runs on a cut-down copy: the same module with each block list cut to its first CUT_BLOCKS
blocks (the released width, the same weights from the same shards, the same export code), exported and compared
against PyTorch in a scratch folder; the full graph is checked by onnx's checker. The manifest says so.
"""

from __future__ import annotations

import copy
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..onnxio.aligned import AlignedData
from .safetensors_shards import Shards

OP = "ai.onnxdiffusion.stream::FloatMatMul"
GATHER_OP = "ai.onnxdiffusion.stream::FloatGather"  # an embedding table left in the shards (export/llm_streamed.py)
_DOMAIN = OP.split("::")[0]
_PLAIN = {OP.split("::")[1]: "MatMul", GATHER_OP.split("::")[1]: "Gather"}
_MAGIC = b"ODFLOAT"  # + one flag byte + the layer's u64 index: a placeholder's 16 bytes (4 float32)
# the flag: 0 a Linear weight [out, in], written transposed (what MatMul takes); 1 a table written as it is
EMBEDDING_FLAG = 1
DATA_NAME = "model.onnx_data"
# a backbone whose fp32 weights pass this is streamed by default (ExportOptions.stream_weights "auto"): the DiTs of
# 4B and up; SDXL's UNet (10.3 GB) stays below (its resnet lists cannot be cut for the cut-down copy). Below it
# the plain export (the bytes it always wrote) peaks near 1.2-1.4x of the fp32 bytes
STREAM_ABOVE = 12 << 30
CUT_BLOCKS = 2


class _FloatMatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, n: int, k: int):
        return x.new_zeros((*x.shape[:-1], n))  # traced over a placeholder: only the shape matters

    @staticmethod
    def symbolic(g, x, w, n: int, k: int):
        y = g.op(OP, x, w, N_i=n, K_i=k)
        sizes = x.type().varyingSizes()  # the exporter's shape inference knows no private op: say [..., N]
        if sizes is not None:
            y.setType(x.type().with_sizes([*sizes[:-1], n]))
        return y


class _FloatGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, table, k: int):
        return torch.zeros((*ids.shape, k), dtype=torch.float32)  # traced over a placeholder: only the shape matters

    @staticmethod
    def symbolic(g, ids, table, k: int):
        y = g.op(GATHER_OP, table, ids)
        sizes = ids.type().varyingSizes()
        if sizes is not None:
            y.setType(ids.type().with_sizes([*sizes, k]).with_dtype(torch.float32))
        return y


def gather_op(ids: torch.Tensor, placeholder: torch.Tensor, k: int) -> torch.Tensor:
    """A traced Gather of rows of width `k` from a table that a placeholder stands for."""
    return _FloatGather.apply(ids, placeholder, k)


class FloatLinear(torch.nn.Module):
    """nn.Linear's interface over a weight `load()` reads from the shards when needed ([out, in] float32)."""

    def __init__(self, load: Callable[[], np.ndarray], index: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None, flag: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.index, self.load = in_features, out_features, index, load
        raw = _MAGIC + bytes([flag]) + struct.pack("<Q", index)
        self.register_buffer("placeholder", torch.from_numpy(np.frombuffer(raw, np.uint8).copy().view(np.float32)))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """For modules that read their Linear's weight dtype or shape: no data (meta), so computing with it fails."""
        return torch.empty((self.out_features, self.in_features), device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            y = _FloatMatMul.apply(x, self.placeholder, self.out_features, self.in_features)
            return y if self.bias is None else y + self.bias
        return torch.nn.functional.linear(x, torch.from_numpy(self.load()), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, streamed"


def streamed_floats(module: torch.nn.Module) -> dict[int, Callable[[], np.ndarray]]:
    """The weight loaders of a module's FloatLinear layers by placeholder index."""
    return {m.index: m.load for m in module.modules() if isinstance(m, FloatLinear)}


def should_stream(folder: Path, setting: str) -> bool:
    """Whether the backbone in `folder` is exported streamed ("on", "off", or "auto": above STREAM_ABOVE)."""
    if setting not in ("auto", "on", "off"):
        raise UserError(f"stream_weights must be auto, on or off, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    if not any(Path(folder).glob("*.safetensors")):
        return False
    try:
        return Shards(folder).fp32_bytes() > STREAM_ABOVE
    except UserError:  # a damaged file: the plain load says what is wrong with it
        return False


def parent_of(module, dotted: str):
    owner, _, leaf = dotted.rpartition(".")
    return (module.get_submodule(owner) if owner else module), leaf


def _reader(shards: Shards, name: str) -> Callable[[], np.ndarray]:
    return lambda: shards.read(name)


def empty_backbone(config_dir: Path, class_name: str):
    """The diffusers `class_name` built from `config_dir`'s config.json with no weights allocated (meta tensors)."""
    import diffusers
    from accelerate import init_empty_weights

    cls = getattr(diffusers, class_name)
    try:
        with init_empty_weights():
            return cls.from_config(cls.load_config(str(config_dir), local_files_only=True))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{config_dir}: cannot build a {class_name} from its config.json: "
                        f"{str(e).splitlines()[0][:200]}") from None


def build_backbone(folder: Path, class_name: str):
    """The diffusers backbone of `folder` with its Linear weights left in the shards."""
    shards = Shards(folder)
    module = empty_backbone(folder, class_name)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(shards.entries))
    if missing:
        raise UserError(f"{folder}: the weights lack {len(missing)} tensor(s) of the {class_name} (first: {missing[0]!r})")
    for name, p in params.items():
        if tuple(p.shape) != shards.entries[name].shape:
            raise UserError(f"{folder}: tensor {name!r} has shape {list(shards.entries[name].shape)}; the config wants "
                            f"{list(p.shape)}")
    done: set[str] = set()
    linears = [(n, m) for n, m in module.named_modules() if type(m) is torch.nn.Linear]
    for index, (name, lin) in enumerate(linears):
        bias = torch.from_numpy(shards.read(f"{name}.bias")) if lin.bias is not None else None
        owner, leaf = parent_of(module, name)
        setattr(owner, leaf, FloatLinear(_reader(shards, f"{name}.weight"), index, lin.out_features,
                                         lin.in_features, bias))
        done.update({f"{name}.weight", f"{name}.bias"})
    for name in params:
        if name not in done:
            owner, leaf = parent_of(module, name)
            setattr(owner, leaf, torch.nn.Parameter(torch.from_numpy(shards.read(name)), requires_grad=False))
    return module.eval()


def write_streamed(model_path: Path, layers: dict[int, Callable[[], np.ndarray]]) -> None:
    """Each placeholder -> its layer's weight [in, out] in the external-data file (written one layer at a time,
    page-aligned, after whatever the exporter already put there), each private op -> MatMul."""
    import onnx

    from ..onnxio.files import write
    from .external_data import consolidate

    model_path = Path(model_path)
    consolidate(model_path, DATA_NAME)  # the exporter's own external files (a > 2 GB graph) into one, first
    model = onnx.load(str(model_path), load_external_data=False)
    slots, tables = {}, set()
    for init in model.graph.initializer:
        raw = init.raw_data
        if len(raw) == len(_MAGIC) + 9 and raw.startswith(_MAGIC):
            slots[struct.unpack("<Q", raw[-8:])[0]] = init
            if raw[len(_MAGIC)] == EMBEDDING_FLAG:
                tables.add(struct.unpack("<Q", raw[-8:])[0])
    data = model_path.parent / DATA_NAME
    with open(data, "ab") as out:
        aligned = AlignedData(out, DATA_NAME)
        for index, init in sorted(slots.items()):
            w = layers[index]()
            w = np.ascontiguousarray(w if index in tables else w.T)
            aligned.put(init, w)  # no bytes copy of the layer
            init.ClearField("dims")
            init.dims.extend(w.shape)
            del w
    for node in model.graph.node:
        if node.domain == _DOMAIN:
            node.domain, node.op_type = "", _PLAIN[node.op_type]
            del node.attribute[:]
    kept = [o for o in model.opset_import if o.domain != _DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    tmp = model_path.with_name(model_path.name + ".tmp")
    write(model, tmp)
    os.replace(tmp, model_path)


def cut_down(module: torch.nn.Module, keep: int = CUT_BLOCKS) -> tuple[torch.nn.Module, dict[str, int]]:
    """A copy of the module with each block list (a ModuleList of one block class, longer than `keep`) cut to its
    first `keep` blocks: the layers' weights stay in the shards, so the copy costs the float parameters only."""
    small = copy.deepcopy(module)
    cut = {}
    for name, sub in list(small.named_modules()):
        if isinstance(sub, torch.nn.ModuleList) and len(sub) > keep and len({type(b) for b in sub}) == 1:
            owner, leaf = parent_of(small, name)
            setattr(owner, leaf, torch.nn.ModuleList(list(sub)[:keep]))
            cut[name] = len(sub)
    return small, cut
