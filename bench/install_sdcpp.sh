#!/usr/bin/env bash
# The stable-diffusion.cpp peer for `onnxdiffusion bench --arch sd15` (sdcpp-fp32, sdcpp-q8_0, sdcpp-q4_0):
# the `stable-diffusion-cpp-python` bindings in their own venv, .venv-sdcpp. PyPI has only its source, so
# pip compiles GGML and stable-diffusion.cpp with cmake (CPU backend, ggml-cpu built -march=native, OpenMP):
# on the 2-core dev machine at load average ~13 this took 20 min (session 6; the better part of an hour at
# load 20+), so it runs niced and is not part of `make peers` / CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-.venv-sdcpp}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} nice -n 10 \
  "$VENV/bin/pip" install -q "stable-diffusion-cpp-python==0.4.7" numpy pillow safetensors
"$VENV/bin/python" -c "import stable_diffusion_cpp; print('stable-diffusion.cpp peer ready')"
touch "$VENV/.installed"
