"""The run time's name for onnxio.session (the one ONNX Runtime session factory)."""

from __future__ import annotations

from ..onnxio.session import (  # noqa: F401 - re-exported
    PROVIDERS, GraphIO, check_external_data, make_session, resolve_provider, session_options,
)
