"""Backbones past protobuf's 2 GB limit: graphs whose weights stay in their external-data files.

A protobuf message cannot be serialized past 2 GB, so a full-size backbone (the SD1.5 UNet is
3.4 GB of fp32 weights) is never turned into bytes in one piece. At or above `limit()` bytes of
tensors the quantize path holds it as a *skeleton*: the graph loaded without its external data,
every large tensor keeping its location, offset and length, and the folder those are relative to
recorded in the model's metadata (DATA_DIR_KEY, set only here, from a checked folder; any value
an input file carries is dropped). A skeleton is a few MB: it is shape-inferred, rewritten,
serialized and handed to ONNX Runtime (which reads the weights from the folder) like any model;
the weights are read into memory only by a tool that must rewrite them (`with_weights`).

Models held in memory (a quantizer's output) are sized by their tensors, not `ByteSize()`, and
go to ONNX Runtime and to other tools through a temporary folder with external data when large.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..errors import UserError
from . import fp16_storage
from .aligned import AlignedData
from .graph_order import subgraphs

DATA_DIR_KEY = "onnxdiffusion.external_data_dir"
# protobuf serializes no message of 2 GiB or more (onnx.save_model, SerializeToString, ByteSize all refuse):
# the one definition of that limit; a model is stored inline only below INLINE_MAX tensor bytes, leaving the
# graph's own bytes (names, shapes, attributes) room under it
TWO_GB = 1 << 31
INLINE_MAX = TWO_GB - (64 << 20)
INLINE_LIMIT = 1 << 30  # serialize in memory below this; larger models go through a temp file
SPILL_PREFIX = "onnxdiffusion-spill-"  # temporary folders holding a streamed quantize's weights


def limit() -> int:
    """Tensor bytes from which a model goes through files (INLINE_LIMIT, read at call time: tests lower it)."""
    return INLINE_LIMIT


def op_counts(model: onnx.ModelProto | onnx.GraphProto) -> Counter:
    """Op types over the graph and every subgraph (If branches, Loop bodies)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    c: Counter = Counter()
    for n in graph.node:
        c[n.op_type] += 1
        for g in subgraphs(n):
            c.update(op_counts(g))
    return c


def all_graphs(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for g in subgraphs(n):
            yield from all_graphs(g)


def attribute_tensors(graph: onnx.GraphProto):
    """The tensors held in node attributes (a Constant's value), this graph's and its subgraphs'."""
    for g in all_graphs(graph):
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors


def _external_length(t: TensorProto) -> int:
    for e in t.external_data:
        if e.key == "length":
            return int(e.value)
    return 0


def tensor_bytes(model: onnx.ModelProto, inline: bool = False) -> int:
    """Bytes of every initializer (subgraphs included), in memory or in external data, without serializing.
    inline=True: only those held in memory (what serializing the model would carry)."""
    total = 0
    for g in all_graphs(model.graph):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                total += 0 if inline else _external_length(t)
            else:
                total += len(t.raw_data) or t.ByteSize()
    return total


def model_bytes(model: onnx.ModelProto) -> int:
    """What the model takes stored: ByteSize below the limit, else tensor bytes plus the graph's."""
    n = tensor_bytes(model)
    if n < limit():
        return model.ByteSize()
    return n + skeleton(model).ByteSize()


def is_large(model: onnx.ModelProto) -> bool:
    return data_dir(model) is not None or tensor_bytes(model) >= limit()


def data_dir(model: onnx.ModelProto) -> Path | None:
    for p in model.metadata_props:
        if p.key == DATA_DIR_KEY:
            return Path(p.value)
    return None


def _drop_key(model: onnx.ModelProto) -> None:
    kept = [p for p in model.metadata_props if p.key != DATA_DIR_KEY]
    if len(kept) != len(model.metadata_props):
        del model.metadata_props[:]
        model.metadata_props.extend(kept)


def load_backbone(path: Path) -> onnx.ModelProto:
    """The backbone at `path` (external data already checked to stay in its folder): a skeleton when its
    tensors reach `limit()`, else the whole model in memory."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf and onnx raise several types
        raise UserError(f"cannot load {path}: {type(e).__name__}") from None
    # a Constant's value in external data (torch's exporter writes them there past 2 GB): graph, not weights, and
    # every graph tool (shape inference, ORT's quantizer, a model rewritten to a temp folder) wants it inline
    _read_external(attribute_tensors(model.graph), path.parent)
    fp16_storage.expand(model, str(path))  # graph tools rewrite float32 initializers
    _drop_key(model)  # never trust a folder named by the input file
    check_ir_version(model, path)
    external = any(t.data_location == TensorProto.EXTERNAL for g in all_graphs(model.graph) for t in g.initializer)
    if external and tensor_bytes(model) >= limit():
        model.metadata_props.add(key=DATA_DIR_KEY, value=str(path.parent.resolve()))
        return model
    if external:
        read_external_data(model, path.parent)
    return model


def skeleton_of(path: Path) -> onnx.ModelProto:
    """The model at `path`, which this package wrote into a folder of its own, as a skeleton of that folder."""
    model = onnx.load(str(path), load_external_data=False)
    _drop_key(model)
    _read_external(attribute_tensors(model.graph), path.parent)
    model.metadata_props.add(key=DATA_DIR_KEY, value=str(Path(path).parent.resolve()))
    return model


def check_ir_version(model: onnx.ModelProto, path: Path) -> None:
    """ONNX Runtime runs a graph whose IR version is unset or out of range, but onnx's shape inference (which the
    graph tools and ORT's quantizer rely on) then types nothing: refuse it here, in one line."""
    from onnx import helper

    # only the opsets a node uses: ORT's optimizer and quantizer declare every domain they know (ai.onnx.ml 5
    # needs IR 10) on IR 8 graphs that use none of them, and shape inference types those graphs fully
    used = {n.domain or "ai.onnx" for g in all_graphs(model.graph) for n in g.node}
    used |= {n.domain or "ai.onnx" for f in model.functions for n in f.node}
    opsets = [o for o in model.opset_import if (o.domain or "ai.onnx") in used]
    try:
        low = helper.find_min_ir_version_for(opsets, ignore_unknown=True) if opsets else 3
    except Exception:  # an opset onnx does not know: the session's own check names it
        low = 3
    if not low <= model.ir_version <= onnx.IR_VERSION:
        raise UserError(f"{path}: IR version {model.ir_version} is not valid for its opsets "
                        f"(this onnx reads {low}..{onnx.IR_VERSION})")


def read_external_data(model: onnx.ModelProto, folder: Path) -> None:
    """Read every external tensor's bytes into it, in place (initializers and node attributes).

    The locations were checked to stay inside `folder` (runtime.session.check_external_data) before
    the model got here. onnx's own reader is not used: it refuses data files with more than one hard
    link, and model folders written by this tool link the files they share with their source.
    """
    inits = (t for g in all_graphs(model.graph) for t in g.initializer)
    _read_external(inits, folder)
    _read_external(attribute_tensors(model.graph), folder)


def _read_external(tensors, folder: Path) -> None:
    from ..folder.manifest import confined

    handles: dict[str, object] = {}
    try:
        for t in tensors:
            if t.data_location != TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            loc = info.get("location")
            if loc is None:
                raise UserError(f"external data of tensor {t.name!r} names no file")
            if loc not in handles:
                handles[loc] = open(confined(folder, loc, f"external data of tensor {t.name!r}"), "rb")
            f = handles[loc]
            f.seek(int(info.get("offset", 0)))
            n = int(info["length"]) if "length" in info else -1
            data = f.read(n)
            if n >= 0 and len(data) != n:
                raise UserError(f"external data of tensor {t.name!r} is truncated ({loc})")
            t.raw_data = data
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
    finally:
        for f in handles.values():
            f.close()


def with_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every weight in memory (for tools that rewrite weights); the model itself if it has them."""
    folder = data_dir(model)
    if folder is None:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _drop_key(out)
    read_external_data(out, folder)
    return out


def array(model: onnx.ModelProto, tensor: TensorProto) -> np.ndarray:
    """One initializer's values, also when `model` is a skeleton whose weights stay in external data."""
    folder = data_dir(model)
    if tensor.data_location == TensorProto.EXTERNAL and folder is not None:
        return tensor_array(tensor, folder)
    return numpy_helper.to_array(tensor)


def read_tensor(tensor: TensorProto, folder: Path) -> TensorProto:
    """A copy of `tensor` with its external bytes read in from `folder` (the tensor itself left a reference)."""
    one = TensorProto()
    one.CopyFrom(tensor)
    _read_external([one], folder)
    return one


def tensor_array(tensor: TensorProto, folder: Path) -> np.ndarray:
    """An external tensor's values read from `folder` (the tensor itself left a reference)."""
    return numpy_helper.to_array(read_tensor(tensor, folder))


def weights_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every weight in memory, that the caller may change (a tool's working copy)."""
    return with_weights(model) if data_dir(model) is not None else copy(model)


def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def skeleton(model: onnx.ModelProto, threshold: int = 1024) -> onnx.ModelProto:
    """A copy without the data of tensors over `threshold` bytes (dims and types kept): enough for
    shape inference and graph inspection, never for running."""
    out = onnx.ModelProto()
    if data_dir(model) is not None and tensor_bytes(model, inline=True) < limit():
        out.CopyFrom(model)  # a skeleton whose in-memory tensors fit: as it is
    else:
        _copy_light(model, out, threshold)  # external tensors stay references; large in-memory ones are stripped
    return out


def _copy_light(model: onnx.ModelProto, out: onnx.ModelProto, threshold: int) -> None:
    # copy everything but large raw_data, graph by graph, so no full-size copy is ever made
    saved = []
    for g in all_graphs(model.graph):
        for t in g.initializer:
            if t.data_location != TensorProto.EXTERNAL and len(t.raw_data) > threshold:
                saved.append((t, t.raw_data))
                n = len(t.raw_data)
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                t.external_data.add(key="location", value="__stripped__")
                t.external_data.add(key="length", value=str(n))
    try:
        out.CopyFrom(model)
    finally:
        for t, raw in saved:
            t.raw_data = raw
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference on a model of any size: run on its skeleton, value_info copied back."""
    if not is_large(model):
        return onnx.shape_inference.infer_shapes(model)
    inferred = onnx.shape_inference.infer_shapes(skeleton(model))
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    return model


@contextmanager
def as_file(model: onnx.ModelProto, name: str = "model.onnx"):
    """A path ONNX Runtime or ORT's tools can load: a skeleton beside links to its data files, a large
    in-memory model with external data, a small one inline. Removed on exit."""
    with tempfile.TemporaryDirectory(prefix="onnxdiffusion-q-") as tmp:
        path = Path(tmp) / name
        # a skeleton is written with its weights (onnx's loader, used by ORT's tools, refuses
        # hard-linked data files, and a symbolic link would name a path outside the folder)
        save(with_weights(model), path)
        yield path


def write(model: onnx.ModelProto, path: Path | str) -> None:
    """Write `model` to one file as it stands: tensors in memory inline, external references kept (their data
    is where the caller put it). Every ONNX file the package writes goes through here or write_external."""
    onnx.save_model(model, str(path))


def write_external(model: onnx.ModelProto, path: Path | str, location: str | None = None) -> str:
    """Write `model` with every tensor over 1 KB in one file beside it (default <file name>_data), moving those
    tensors out of `model` in place (onnx's way); returns the data file's name."""
    location = location or Path(path).name + "_data"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=1024, convert_attribute=False)
    return location


def save(model: onnx.ModelProto, path: Path, keep: bool = True, external_from: int | None = None) -> list[str]:
    """Save inline below the limit (and below `external_from` bytes of tensors when given: a model folder's
    component, relayout.RUNTIME_EXTERNAL_BYTES), else every tensor over 1 KB in one external file beside it.
    Returns the external files' names. keep=False: the model's large tensors are left pointing at
    the written file (not read back): for a model the caller is done with."""
    if data_dir(model) is not None:
        return _save_skeleton(model, Path(path), keep)
    inline_below = min(limit(), INLINE_MAX, TWO_GB if external_from is None else external_from)
    if tensor_bytes(model) < inline_below:
        write(model, path)
        return []
    data = write_external(model, path)
    if keep:  # onnx.save_model moved the tensors out in place: read them back
        read_external_data(model, Path(path).parent)
    return [data]


def _save_skeleton(model: onnx.ModelProto, path: Path, keep: bool) -> list[str]:
    """A skeleton written with every external tensor copied, one at a time, into one file beside `path` (page-aligned,
    as export lays files out): a model whose weights were never in memory (quantize/streamed.py) stays so.
    keep=True: `model` stays a skeleton, of the new folder."""
    from ..folder.manifest import confined

    folder, location = data_dir(model), path.name + "_data"
    work = model if not keep else copy(model)
    _drop_key(work)
    handles = {}
    try:
        with open(path.parent / location, "wb") as out:
            data = AlignedData(out, location)
            for g in all_graphs(work.graph):
                for t in g.initializer:
                    if t.data_location != TensorProto.EXTERNAL:
                        continue
                    info = {e.key: e.value for e in t.external_data}
                    loc = info["location"]
                    if loc not in handles:
                        handles[loc] = open(confined(folder, loc, f"external data of tensor {t.name!r}"), "rb")
                    src = handles[loc]
                    src.seek(int(info.get("offset", 0)))
                    data.copy(t, src, int(info["length"]), f"external data of tensor {t.name!r} ({loc})")
    finally:
        for f in handles.values():
            f.close()
    write(work, path)
    if keep:
        model.CopyFrom(work)
        model.metadata_props.add(key=DATA_DIR_KEY, value=str(path.parent.resolve()))
    return [location]


def session_source(model: onnx.ModelProto, options) -> bytes | None:
    """Bytes for an InferenceSession when the model can be serialized (a skeleton: its data folder goes into
    `options`); None when it must go through `as_file`."""
    folder = data_dir(model)
    if folder is not None and tensor_bytes(model, inline=True) < limit():  # tensors a rewrite added count too
        work = copy(model)
        _drop_key(work)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        return work.SerializeToString()
    if folder is None and tensor_bytes(model) < limit():
        return model.SerializeToString()
    return None
