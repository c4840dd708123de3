"""The lora verbs' options: `lora points` (adapters/folder.add_points) and `lora convert`
(adapters/convert.convert_lora), apart from those modules so the CLI reads them without importing the families."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fields import option


@dataclass(frozen=True)
class PointsOptions:
    """`add_points(model, out, scope=o.scope, overwrite=o.overwrite)`."""
    scope: str = option("linear", "linear (Linear and 1x1 conv layers) | all (k x k convs too)")
    overwrite: bool = option(False, "")


@dataclass(frozen=True)
class ConvertOptions:
    """`convert_lora(src, out, o.model, overwrite=o.overwrite)`."""
    model: Path | None = option(None, "the exported model folder it is for (its family and configs)")
    overwrite: bool = option(False, "")
