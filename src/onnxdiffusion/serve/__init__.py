"""HTTP service over the runtime pipeline (the `serve` extra: FastAPI, uvicorn, prometheus_client).

Nothing here is imported by the core; `app` and `ray` import their frameworks, the rest is plain Python.
"""

from .config import ServeConfig

__all__ = ["ServeConfig"]
