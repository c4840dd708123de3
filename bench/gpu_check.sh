#!/usr/bin/env bash
# The GPU path, checked in one command on a lent NVIDIA GPU (budget: < 8 minutes):
#   bench/gpu_check.sh
# GPU vs CPU image parity, FP16 / FP8 backbone latency vs FP32, CUDA graph on/off, TensorRT vs the
# CUDA provider, on the embedded model. Installs onnxruntime-gpu (+ TensorRT libraries) into its own
# venv. Without a GPU it prints why and exits 0 ("skipped"); CI never runs it.
set -u
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "gpu_check: skipped: no NVIDIA GPU visible (nvidia-smi finds none)"
  exit 0
fi
nvidia-smi -L
PY=${PY:-python3}
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
export HF_HUB_OFFLINE=1 TQDM_DISABLE=1
exec timeout 420 "$VENV/bin/python" bench/gpu_check.py "$@"
