#!/usr/bin/env bash
# The OpenVINO peer for `onnxdiffusion bench` (openvino-fp32, openvino-int8-hybrid): optimum-intel in its
# own venv, .venv-openvino, so it never pins the project's dependencies. torch is pinned to the CPU build
# first (torchvision 0.28 matches torch 2.13): otherwise optimum-intel's torchvision pulls a CUDA torch
# (about 6 GB). Without this venv the bench reports both OpenVINO variants as "not installed".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-.venv-openvino}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "torch==2.13.0" "torchvision==0.28.*" "optimum-intel[openvino]==2.2.*" \
  "diffusers==0.39.*" "transformers==4.57.*"
"$VENV/bin/python" -c "import optimum.intel, openvino; print('openvino peer ready:', openvino.__version__)"
touch "$VENV/.installed"
