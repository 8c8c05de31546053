"""Rollouts from vLLM's Python API, written as JSONL for `workbench import` (run in vLLM's own venv).

    $WORKBENCH_VLLM_PYTHON tests/helpers/vllm_rollouts.py MODEL_FOLDER OUT.jsonl

One `LLM` (CPU, fp32, eager: no compile warm-up) in `processed_logprobs` mode, as an RL rollout
engine that reports the logprobs it sampled from: 8 seeded requests at temperature 1.0 (processed
equals raw there) and 4 at temperature 0.6 (processed differs from raw, which the trainer and the
reference compute). Each `RequestOutput` goes through `workbench.external.imports.rows_from_request_outputs`,
duck-typed on the real objects; the import module needs only the standard library. The `__main__`
guard is needed: vLLM starts its engine core in a spawned process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are", "Water boils at a temperature of", "The quick brown fox",
           "In 1969, the first person to walk on the Moon was", "List three fruits:"]
NEW = 16
TOP = 5


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's workbench package
    from vllm import LLM, SamplingParams

    from workbench.external.imports import rows_from_request_outputs

    folder, out = sys.argv[1], sys.argv[2]
    llm = LLM(model=folder, dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
              logprobs_mode="processed_logprobs")
    params = [{"temperature": 1.0, "seed": 100 + i} for i in range(len(PROMPTS))]
    params += [{"temperature": 0.6, "seed": 200 + i} for i in range(4)]
    prompts = PROMPTS + PROMPTS[:4]
    tok = llm.get_tokenizer()
    inputs = [{"prompt_token_ids": tok.encode(p), "prompt": p} for p in prompts]
    sampling = [SamplingParams(max_tokens=NEW, logprobs=TOP, **p) for p in params]
    outputs = llm.generate([{"prompt_token_ids": x["prompt_token_ids"]} for x in inputs], sampling, use_tqdm=False)
    rows = rows_from_request_outputs(outputs, params)
    with open(out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"@@rollouts {len(rows)} rows written to {out}", flush=True)


if __name__ == "__main__":
    main()
