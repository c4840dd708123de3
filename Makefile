# The two commands in the README: `make demo` (main job on the embedded model) and `make test`; `make test-fast`
# is the inner loop (the suite without its slow, browser and peer tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_CONFIG ?= models/training/configs/shapes-sd.json
MMDIT_CONFIG ?= models/training/configs/shapes-mmdit.json
export HF_HUB_OFFLINE := 1

.PHONY: demo test test-fast install-run install-dev model model-export controlnet-weights model-mmdit model-mmdit-export peers web-deps web clean

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

# demo ends with a short bench of every variant found (PyTorch and peers only where installed; the others
# are listed in the report as not run, with the reason)
demo: $(VENV)/.run-installed $(VENV)/.bench-installed
	mkdir -p out
	$(BIN)/onnxdiffusion generate "a small red circle on the left" --steps 20 --seed 0 -o out/demo.png --overwrite
	$(BIN)/onnxdiffusion generate "a blue star above a yellow square" --sampler dpmpp_2m --steps 20 --batch 4 -o out/demo-pair.png --overwrite
	@echo "images written to out/"
	$(BIN)/onnxdiffusion bench --steps 10 --repeats 5 --prompts 8 --out out/bench
	@echo "bench report: $(CURDIR)/out/bench/report.html"

# the bench's plots need matplotlib (not a run-time dependency)
$(VENV)/.bench-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[bench]'
	touch $@

# The browser page's npm packages (onnxruntime-web, @huggingface/tokenizers), pinned by
# src/onnxdiffusion/web/package-lock.json: `npm ci` into ~/.cache/onnxdiffusion/web (never the source tree).
web-deps: $(VENV)/.run-installed
	$(BIN)/python -m onnxdiffusion.web.npm

# The embedded model as a static page (out/web); open it with `python -m http.server -d out/web`.
web: web-deps
	mkdir -p out
	$(BIN)/onnxdiffusion export-web models/shapes-sd-onnx out/web --overwrite

# TEST_JOBS pytest-xdist workers taking tests as they free up (shared artefacts built once under a file lock, one
# thread per worker on 2 cores: tests/conftest.py); TEST_JOBS=0: one process, the libraries' default threads
TEST_JOBS ?= 2
test: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal

# the inner loop: the suite without the tests marked slow, browser or peers (pyproject.toml's markers)
test-fast: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal -m "not slow and not browser and not peers"

# Retrain the embedded model from scratch (about two hours on 2 CPU cores), then export it.
model: $(VENV)/.dev-installed
	$(BIN)/python models/training/train_pipeline.py $(MODEL_CONFIG) --stage vae --work runs/shapes-sd
	$(BIN)/python models/training/train_pipeline.py $(MODEL_CONFIG) --stage unet --work runs/shapes-sd
	$(BIN)/python models/training/train_judge.py --out models/judge
	PYBIN=$(BIN) models/training/finish.sh runs/shapes-sd models/shapes-sd models/shapes-sd-onnx

# Retrain the SD3-family model (MMDiT, flow matching) from scratch on the shipped shapes-sd VAE and text
# encoder (about an hour on 2 CPU cores), evaluate it (guidance picked on the calib split), store it in float16 (the evaluation is of the float16-stored weights),
# then re-export it into models/shapes-mmdit-onnx (model-mmdit-export).
model-mmdit: $(VENV)/.dev-installed
	$(BIN)/python models/training/train_mmdit.py $(MMDIT_CONFIG) --stage train --work runs/shapes-mmdit
	$(BIN)/python models/training/train_mmdit.py $(MMDIT_CONFIG) --stage assemble --work runs/shapes-mmdit --out models/shapes-mmdit
	$(BIN)/python models/training/to_fp16.py models/shapes-mmdit
	$(BIN)/python models/training/finish_mmdit.py $(MMDIT_CONFIG) --work runs/shapes-mmdit --model models/shapes-mmdit
	$(MAKE) model-mmdit-export

# The shipped MMDiT exported (fp32; no vae_encoder: text-to-image never runs it; recommended settings from its
# eval.json), evaluated through ONNX Runtime on the card's 256 held-out pairs (~2 min), card rewritten with both.
model-mmdit-export: $(VENV)/.dev-installed
	$(BIN)/python models/training/export_shipped.py models/shapes-mmdit models/shapes-mmdit-onnx
	$(BIN)/onnxdiffusion evaluate models/shapes-mmdit-onnx --count 256 -o models/shapes-mmdit/eval_onnx.json --overwrite
	$(BIN)/python models/training/finish_mmdit.py $(MMDIT_CONFIG) --work runs/shapes-mmdit --model models/shapes-mmdit \
		--card-only --onnx models/shapes-mmdit-onnx --onnx-eval models/shapes-mmdit/eval_onnx.json

# The shipped ControlNet's diffusers weights: only the ONNX folder's copy of the net is tracked, this writes the
# diffusers file back from it, byte for byte (checked against the folder's weights.sha256)
NET_WEIGHTS := models/controlnets/shapes-sd-position/diffusion_pytorch_model.safetensors
controlnet-weights: $(NET_WEIGHTS)
$(NET_WEIGHTS): | $(VENV)/.dev-installed
	$(BIN)/python models/training/controlnet_weights.py

model-export: $(VENV)/.dev-installed $(NET_WEIGHTS)
	$(BIN)/python models/training/export_shipped.py models/shapes-sd models/shapes-sd-onnx position=models/controlnets/shapes-sd-position

# Peers live in their own venvs so they never pin our dependencies (interop tests and bench). Each install
# ends with an import check, so a peer that installs but cannot load fails here, not in a report.
# Cost (2-core dev machine, warm pip cache): optimum ~50 s / 1.3 GB, openvino ~45 s (4 min under load) / 1.6 GB.
peers: .venv-optimum/.installed .venv-openvino/.installed
.venv-optimum/.installed:
	$(PY) -m venv .venv-optimum
	.venv-optimum/bin/pip install -q --upgrade pip
	.venv-optimum/bin/pip install -q torch==2.13.0
	.venv-optimum/bin/pip install -q "optimum-onnx[onnxruntime]==0.1.0" "diffusers==0.39.*" "transformers==4.57.*"
	.venv-optimum/bin/python -c "from optimum.onnxruntime import ORTStableDiffusionPipeline"
	touch $@
.venv-openvino/.installed: bench/install_openvino.sh
	PY=$(PY) bash bench/install_openvino.sh

clean:
	rm -rf $(VENV) out runs
