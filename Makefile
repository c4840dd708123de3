# The two commands in the README: `make demo` (main job on the embedded model) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_CONFIG ?= models/training/configs/shapes-sd.json
GUIDANCE ?= 4.0
export HF_HUB_OFFLINE := 1

.PHONY: demo test install-run install-dev model model-export peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# run-time only: numpy, onnxruntime, tokenizers, Pillow (no torch)
$(VENV)/.run-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# export/training extra + test tools; torch first so pip never pulls a CUDA build
$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,dev]'
	touch $@ $(VENV)/.run-installed

install-run: $(VENV)/.run-installed
install-dev: $(VENV)/.dev-installed

demo: $(VENV)/.run-installed
	mkdir -p out
	$(BIN)/onnxdiffusion generate "a small red circle on the left" --steps 20 --seed 0 -o out/demo.png
	$(BIN)/onnxdiffusion generate "a blue star above a yellow square" --sampler dpmpp_2m --steps 20 --batch 4 -o out/demo-pair.png
	@echo "images written to out/"

test: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

# Retrain the embedded model from scratch (about two hours on 2 CPU cores), then export it.
model: $(VENV)/.dev-installed
	$(BIN)/python models/training/train_pipeline.py $(MODEL_CONFIG) --stage vae --work runs/shapes-sd
	$(BIN)/python models/training/train_pipeline.py $(MODEL_CONFIG) --stage unet --work runs/shapes-sd
	$(BIN)/python models/training/train_pipeline.py $(MODEL_CONFIG) --stage assemble --work runs/shapes-sd --out models/shapes-sd
	$(BIN)/python models/training/train_judge.py --out models/judge
	$(MAKE) model-export
	$(BIN)/onnxdiffusion evaluate models/shapes-sd-onnx --count 256 --guidance $(GUIDANCE) -o models/shapes-sd/eval.json
	$(BIN)/python models/training/make_card.py --work runs/shapes-sd --model models/shapes-sd --onnx models/shapes-sd-onnx --eval models/shapes-sd/eval.json

model-export: $(VENV)/.dev-installed
	$(BIN)/onnxdiffusion export models/shapes-sd models/shapes-sd-onnx --overwrite

# Peers live in their own venvs so they never pin our dependencies (interop tests and bench).
peers: .venv-optimum/.installed
.venv-optimum/.installed:
	$(PY) -m venv .venv-optimum
	.venv-optimum/bin/pip install -q --upgrade pip
	.venv-optimum/bin/pip install -q torch==2.13.0
	.venv-optimum/bin/pip install -q "optimum-onnx[onnxruntime]==0.1.0" "diffusers==0.39.*" "transformers==4.57.*"
	touch $@

clean:
	rm -rf $(VENV) out runs
