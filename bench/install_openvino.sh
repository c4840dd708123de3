#!/usr/bin/env bash
# The OpenVINO peer for `onnxdiffusion bench` (openvino-fp32, openvino-int8-hybrid): optimum-intel in its
# own venv, .venv-openvino, so it never pins the project's dependencies.
#
# torch is pinned to the CPU build first: otherwise a plain `torch` requirement pulls a CUDA build (GBs).
# optimum-intel lists torchvision as a requirement, but PyPI's torchvision does not import beside that CPU
# wheel ("operator torchvision::nms does not exist"), and a torchvision that is installed but broken breaks
# transformers' AutoProcessor and with it `from optimum.intel import OVStableDiffusionPipeline`. The Stable
# Diffusion path never uses torchvision, so it is removed after the install: transformers then sees no
# torchvision and imports cleanly. (The alternative, torch 2.9.1 CPU + torchvision 0.24.1, costs a second
# torch download; this one reuses the CPU wheel the project already pins.) Measured on the 2-core dev
# machine: ~45 s with a warm pip cache, 1.6 GB in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-.venv-openvino}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "torch==2.13.0" "optimum-intel[openvino]==2.2.*" "diffusers==0.39.*" "transformers==4.57.*"
"$VENV/bin/pip" uninstall -q -y torchvision
"$VENV/bin/python" -c "from optimum.intel import OVStableDiffusionPipeline; import openvino; print('openvino peer ready:', openvino.__version__)"
touch "$VENV/.installed"
