"""The step-caching methods by name: a new method is its module, ``techniques/cache_<name>.py`` (a ``CacheSpec``
subclass whose ``method`` is ``<name>``), and one line here: its name in ``NAMES``."""

from __future__ import annotations

from importlib import import_module

from .cache_base import CacheSpec

# in the order usage texts and errors list them
NAMES = (
    "first_block",
    "taylorseer",
    "deepcache",
    "residual",
    "magcache",
)


def _spec(name: str) -> type[CacheSpec]:
    """The CacheSpec subclass of ``cache_<name>.py`` that answers to `name`."""
    module = import_module(f"{__package__}.cache_{name}")
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, CacheSpec) and v.__module__ == module.__name__ and v.method == name]
    if len(found) != 1:
        raise ImportError(f"{module.__name__} defines {len(found)} CacheSpec classes with method {name!r}; one expected")
    return found[0]


METHODS: dict[str, type[CacheSpec]] = {name: _spec(name) for name in NAMES}
