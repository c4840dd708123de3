"""Numpy samplers expressed as per-step coefficient tables (no torch / diffusers imports)."""

from .config import calculate_shift, default_sampler, resolve, schedule_from_config, table_from_config
from .denoiser import cfg_batch, cfg_combine, cfg_split, guided
from .host import iter_sample, sample
from .options import SamplerOptions
from .tables import COLUMNS, DISCRETE_SAMPLERS, FLOW_SAMPLERS, SAMPLERS, SamplerTable, build_table, samplers_for

__all__ = [
    "COLUMNS", "SAMPLERS", "DISCRETE_SAMPLERS", "FLOW_SAMPLERS", "SamplerTable", "SamplerOptions", "build_table",
    "samplers_for", "table_from_config", "schedule_from_config", "resolve", "default_sampler", "calculate_shift",
    "iter_sample", "sample",
    "cfg_batch", "cfg_combine", "cfg_split", "guided",
]
