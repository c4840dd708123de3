"""The step-caching methods by name: a new method is its module and one line here."""

from __future__ import annotations

from .cache_base import CacheSpec
from .cache_deepcache import DeepCache
from .cache_first_block import FirstBlock
from .cache_magcache import MagCache
from .cache_residual import Residual
from .cache_taylorseer import TaylorSeer

METHODS: dict[str, type[CacheSpec]] = {m.method: m for m in (FirstBlock, TaylorSeer, DeepCache, Residual, MagCache)}
