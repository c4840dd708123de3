"""ONNX Runtime sessions: provider choice and clear errors for unusable models."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from ..errors import UserError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}


def resolve_provider(name: str) -> list[str]:
    """Provider list for ORT: the requested one, then CPU as the fallback for unsupported ops."""
    key = name.lower()
    if key not in PROVIDERS:
        raise UserError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[key]
    available = ort.get_available_providers()
    if wanted not in available:
        names = ", ".join(k for k, v in PROVIDERS.items() if v in available)
        raise UserError(f"provider {name!r} is not available in this onnxruntime install (available: {names})")
    return [wanted] if wanted == "CPUExecutionProvider" else [wanted, "CPUExecutionProvider"]


def check_external_data(path: Path) -> None:
    """Untrusted folders: every external-data file must resolve inside the model's own folder."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    path = Path(path)
    if not path.is_file():
        raise UserError(f"model file missing: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf decode errors have no common public type
        raise UserError(f"cannot load {path}: not a valid ONNX file ({type(e).__name__})") from None
    root = path.parent.resolve()
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            target = (root / ExternalDataInfo(tensor).location).resolve()
            if root not in target.parents:
                raise UserError(f"{path}: external data {ExternalDataInfo(tensor).location!r} points outside {root}")


def make_session(path: Path, provider: str = "cpu", threads: int | None = None,
                 disabled_optimizers: list[str] | None = None, providers: list | None = None) -> ort.InferenceSession:
    """`providers`: ONNX Runtime's provider list with options (a profile's); default: `provider`, then CPU."""
    check_external_data(path)
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    try:
        extra = {"disabled_optimizers": disabled_optimizers} if disabled_optimizers else {}
        chain = providers if providers is not None else resolve_provider(provider)
        return ort.InferenceSession(str(path), sess_options=opts, providers=chain, **extra)
    except UserError:
        raise
    except Exception as e:  # ORT raises several private exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load {path}: {first[:300]}") from None
