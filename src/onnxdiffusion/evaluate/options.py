"""evaluate's options, apart from evaluate/run.py so the CLI reads them without importing the judge."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import option


@dataclass(frozen=True)
class EvaluateOptions:
    """The CLI leaves steps / sampler / guidance None: the verb resolves them as generate does (the model's
    recommended settings) before the run; the Python defaults are the fixed ones the results tables used."""
    count: int = option(256, "1..4096 held-out prompts")
    steps: int = option(20, "default: the model's recommended, else 20", cli_default=None, cli_type=int | None)
    sampler: str | None = option("ddim", "default: the model's recommended, else the folder's scheduler",
                                 cli_default=None)  # None: the one the folder's scheduler_config.json names
    guidance: float = option(4.0, "default: the model's recommended, else 7.5", cli_default=None,
                             cli_type=float | None)
    batch: int = option(32, "1..4096 images per run")
    split: str = "heldout"
    seed_offset: int = 0
    decoder: str = option("full", "full (the VAE) | tiny (the folder's tiny autoencoder)")  # full | tiny
