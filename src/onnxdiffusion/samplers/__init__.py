"""Numpy samplers expressed as per-step coefficient tables (no torch / diffusers imports)."""

from .denoiser import cfg_batch, cfg_combine, cfg_split, guided
from .host import iter_sample, sample
from .tables import COLUMNS, SAMPLERS, SamplerTable, build_table

__all__ = [
    "COLUMNS", "SAMPLERS", "SamplerTable", "build_table",
    "iter_sample", "sample",
    "cfg_batch", "cfg_combine", "cfg_split", "guided",
]
