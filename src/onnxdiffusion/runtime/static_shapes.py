"""One session per input-shape signature, each compiled for those shapes alone (a profile's `static_shapes`).

OpenVINO compiles a graph with symbolic dimensions into kernels that re-plan on every call; the same
graph reshaped to the call's shapes runs faster (the full-size SD1.5 UNet step on an AMX Xeon, 1 thread,
int8 with bf16 float parts: 0.53-0.56 -> 0.46-0.48 s, interleaved runs). ONNX Runtime's OpenVINO provider
takes the shapes as its `reshape_input` option, fixed for the session's life, so a new shape (another size,
another batch) gets a session of its own, compiled on its first call: the last few are kept. The pipeline keys its backbone this
way; components that run once an image would pay a compile per new shape for little (runtime/pipeline.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

Shapes = dict[str, tuple[int, ...]]


def reshape_input(shapes: Shapes) -> str:
    """The OpenVINO provider's `reshape_input` value: "name[d0,d1,...],..." in input order."""
    return ",".join(f"{name}[{','.join(str(int(d)) for d in dims)}]" for name, dims in shapes.items())


def _openvino(entry) -> bool:
    return isinstance(entry, tuple) and entry[0] == "OpenVINOExecutionProvider"


def with_shapes(chain: list, shapes: Shapes) -> list:
    """A provider list whose OpenVINO entry is fixed to `shapes` (other entries as they are)."""
    return [(e[0], {**e[1], "reshape_input": reshape_input(shapes)}) if _openvino(e) else e for e in chain]


class ShapeKeyedSession:
    """Quacks like the InferenceSession it stands for: `run` picks (or makes) the session of the feeds'
    shapes; `for_shapes` gives that session itself (the IO-bound backbone binds to it). `io` lists the
    graph's inputs and outputs (onnxio.session.GraphIO) without a session."""

    def __init__(self, make: Callable[[Shapes], object], io, keep: int = 2):
        self._make, self._io, self._keep = make, io, keep
        self._sessions: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # sessions made so far (a new shape each)

    def for_shapes(self, shapes: Shapes):
        names = [i.name for i in self._io.get_inputs()]
        ordered = {n: tuple(int(d) for d in shapes[n]) for n in names if n in shapes}
        key = tuple(ordered.items())
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._make(ordered)
                self.compiled += 1
                self._sessions[key] = session
                while len(self._sessions) > self._keep:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(key)
            return session

    def run(self, output_names, feeds, run_options=None):
        return self.for_shapes({k: v.shape for k, v in feeds.items()}).run(output_names, feeds, run_options)

    def get_inputs(self):
        return self._io.get_inputs()

    def get_outputs(self):
        return self._io.get_outputs()


def session_factory(static: bool, chain: list | None, path, make: Callable[..., object],
                    io=None) -> Callable[[], object]:
    """A factory of `path`'s session: `make(path, providers=..., [model=...])` under `chain`, or with `static`
    a ShapeKeyedSession making one that way per shape (`io`: the graph's inputs, read from the file if None).
    On ONNX Runtime's OpenVINO provider the plain fused attention is written out first (onnxio.attention): a graph
    still holding ORT-only operators runs in provider pieces, whose inputs are not the graph's (no static shapes)."""
    openvino = any(map(_openvino, chain or []))

    def build():
        if not (openvino or static):  # the file as it is, parsed once (by make_session's own check)
            return make(path, providers=chain)
        from ..onnxio.attention import openvino_form
        from ..onnxio.session import check_external_data

        graph = io if io is not None else check_external_data(path)
        model = openvino_form(path) if openvino and graph.written_out else None

        def one(providers):
            return make(path, providers=providers) if model is None else make(path, providers=providers, model=model)
        if not static or graph.foreign_ops:
            return one(chain)
        return ShapeKeyedSession(lambda shapes: one(with_shapes(chain or [], shapes)), graph)
    return build


def session_for(session, shapes: Shapes):
    """The session to bind buffers of these shapes to: the shape's own under a ShapeKeyedSession."""
    return session.for_shapes(shapes) if isinstance(session, ShapeKeyedSession) else session
