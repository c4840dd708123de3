"""The few array operations a family's `combine` is written against (base.Family.combine): numpy at run time
(NumpyOps), ONNX nodes in the one-graph `--whole` form (loopgraph/whole.py)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..errors import UserError


class Ops(Protocol):
    """The few array operations `combine` needs; numpy here, ONNX nodes in the whole graph."""

    def concat(self, xs: list[Any], axis: int) -> Any: ...
    def pad_last(self, x: Any, width: int) -> Any: ...
    def zeros(self, like: Any, tail: tuple[int, ...]) -> Any: ...


class NumpyOps:
    def concat(self, xs: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    def pad_last(self, x: np.ndarray, width: int) -> np.ndarray:
        if x.shape[-1] > width:
            raise UserError(f"cannot pad width {x.shape[-1]} down to {width}")
        return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    def zeros(self, like: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
        """Zeros of shape (batch of `like`, *tail)."""
        return np.zeros((like.shape[0], *tail), np.float32)
