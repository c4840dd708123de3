#!/usr/bin/env bash
# The GPU path, checked in one command on a lent NVIDIA GPU (budget: < 8 minutes):
#   bench/gpu_check.sh
# GPU vs CPU image parity, FP16 / FP8 backbone latency vs FP32, CUDA graph on/off, TensorRT vs the
# CUDA provider, on the embedded model. Installs onnxruntime-gpu (+ TensorRT libraries) into its own
# venv. Without a GPU it prints why and exits 0 ("skipped"); CI never runs it.
# A machine without network: pack onnxruntime-gpu with bench/gpu_bundle.py (one GPU generation, two
# parts under 64 MiB), send the parts, and run with ORT_GPU_BUNDLE=<folder of the parts> (and
# ORT_GPU_DIR=<where to unpack>, kept between transfers). Ran so on a lent H200: bench/results/gpu_check.md.
set -u
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "gpu_check: skipped: no NVIDIA GPU visible (nvidia-smi finds none)"
  exit 0
fi
nvidia-smi -L
PY=${PY:-python3}
export HF_HUB_OFFLINE=1 TQDM_DISABLE=1
if [ -n "${ORT_GPU_BUNDLE:-}" ]; then
  # Offline machine: onnxruntime-gpu comes packed by bench/gpu_bundle.py (parts may arrive in separate
  # transfers: each present part is unpacked, the rest must already be in $ORT_GPU_DIR). The machine's
  # own python3 supplies numpy/onnx/tokenizers/Pillow/PyYAML and CUDA's libraries (nvidia-* wheels).
  DEST=${ORT_GPU_DIR:-${TMPDIR:-/tmp}/onnxdiffusion-ortgpu}
  mkdir -p "$DEST"
  for part in "$ORT_GPU_BUNDLE"/*.tar.xz; do
    [ -e "$part" ] || continue
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$part" "$DEST" \
      || { echo "gpu_check: failed: cannot unpack $part"; exit 2; }
  done
  [ -e "$DEST/onnxruntime/capi/libonnxruntime_providers_cuda.so" ] || { echo "gpu_check: unpacked the parts present; the CUDA provider part is still missing"; exit 3; }
  ls "$DEST"/onnxruntime/capi/onnxruntime_pybind11_state*.so >/dev/null 2>&1 || { echo "gpu_check: unpacked the parts present; the core part is still missing"; exit 3; }
  NV=$("$PY" -c "import os, nvidia; b = list(nvidia.__path__)[0]; print(':'.join(sorted({r for r, _, fs in os.walk(b) if any('.so' in f for f in fs)})))" 2>/dev/null)
  export PYTHONPATH="$DEST:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="${NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  exec timeout 420 "$PY" bench/gpu_check.py "$@"
fi
VENV=${GPU_VENV:-${TMPDIR:-/tmp}/onnxdiffusion-gpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || { echo "gpu_check: failed: cannot create a venv with $PY"; exit 2; }
fi
PIP="$VENV/bin/pip"
if ! "$VENV/bin/python" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
  echo "gpu_check: installing onnxruntime-gpu (CUDA 12 + cuDNN from PyPI) and this package"
  "$PIP" install -q -e . || { echo "gpu_check: failed: pip install -e . (no package index reachable?)"; exit 2; }
  "$PIP" uninstall -q -y onnxruntime >/dev/null 2>&1
  "$PIP" install -q "onnxruntime-gpu[cuda,cudnn]" || { echo "gpu_check: failed: pip install onnxruntime-gpu"; exit 2; }
  # TensorRT's libraries for the TensorRT provider; the check reports TensorRT as unavailable without them
  "$PIP" install -q "tensorrt-cu12-libs" || echo "gpu_check: TensorRT libraries not installed; TensorRT rows will be skipped"
fi
exec timeout 420 "$VENV/bin/python" bench/gpu_check.py "$@"
