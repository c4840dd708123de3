"""One external-data file written in order, every tensor starting on a page: ONNX Runtime maps such files instead of
reading them, so a full-size backbone's weights stay file-backed. Export (consolidating the exporter's files,
streamed float and GGUF layers) and quantize (a streamed build's spill, a skeleton's save) all lay files out so."""

from __future__ import annotations

from typing import BinaryIO

from onnx import TensorProto

from ..errors import UserError

PAGE = 4096
CHUNK = 64 << 20  # a copied tensor moves in pieces: one full-size weight is up to a few hundred MB


def point_at_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """Make an initializer read its bytes from `location` (beside the model) at `offset`, dropping any inline copy."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


class AlignedData:
    """Appends tensors to `file` (open for binary writing, at its end), named `location` beside the model."""

    def __init__(self, file: BinaryIO, location: str):
        self.file, self.location = file, location
        self.offset = file.tell()

    def _start(self) -> int:
        pad = (-self.offset) % PAGE
        if pad:
            self.file.write(b"\0" * pad)
        self.offset += pad
        return self.offset

    def put(self, tensor: TensorProto, data) -> None:
        """`tensor`'s bytes are `data` (bytes or a contiguous array's buffer, written without a copy)."""
        view = memoryview(data).cast("B")
        start = self._start()
        self.file.write(view)
        self.offset += view.nbytes
        point_at_external(tensor, self.location, start, view.nbytes)

    def copy(self, tensor: TensorProto, source: BinaryIO, length: int, what: str) -> None:
        """`tensor`'s bytes are the next `length` bytes of `source`, copied in pieces (never whole in memory)."""
        start = self._start()
        point_at_external(tensor, self.location, start, length)
        left = length
        while left > 0:
            chunk = source.read(min(left, CHUNK))
            if not chunk:
                raise UserError(f"{what} is truncated")
            self.file.write(chunk)
            left -= len(chunk)
            self.offset += len(chunk)
