"""The quantizer's name for onnxio.files (ONNX files, skeletons of > 2 GB backbones, external data)."""

from __future__ import annotations

from ..onnxio.files import (  # noqa: F401 - re-exported
    DATA_DIR_KEY, INLINE_LIMIT, TWO_GB, all_graphs, array, as_file, copy, data_dir, infer_shapes, is_large,
    limit, load_backbone, model_bytes, read_external_data, save, session_source, skeleton, tensor_bytes,
    weights_copy, with_weights,
)
