"""A peer engine (vLLM CPU or llama.cpp) kept loaded in its own virtual environment, answering
timed generation requests from benchmarks/throughput.py over stdin/stdout, one JSON object a line.

Run by peers.py under the peer's own Python (it imports only the standard library and the peer):

    .venv-vllm/bin/python benchmarks/peer_worker.py vllm --model FOLDER [--eager]
    .venv-llamacpp/bin/python benchmarks/peer_worker.py llamacpp --model FILE.gguf

Each answer is a line starting with `@@peer `. It prints {"ready": true, "load_s": ...} once loaded, then for each request line
{"prompts": [[token ids], ...], "new": N, "eos": bool, "batch": 1 or 32} prints {"tokens": ..., "seconds": ...}
(greedy; with "eos" false every request runs exactly N tokens). Errors print {"error": "..."}.
llama-cpp-python has no batched multi-sequence API at this level: its requests run one after another.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

MARK = "@@peer "  # the peers log to stdout too: only lines with this mark are answers


def _say(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class VllmPeer:
    def __init__(self, model: str, eager: bool) -> None:
        from vllm import LLM

        self.llm = LLM(model=model, dtype="float32", enforce_eager=eager, max_model_len=2048, seed=0)

    def run(self, prompts: list[list[int]], new: int, eos: bool, batch: int) -> dict:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=not eos)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        groups = [inputs] if batch > 1 else [[x] for x in inputs]
        # warm-up on the whole batch, as for the engine and transformers; then its prefix cache is
        # emptied, so nothing of the warm-up (or an earlier round: this process serves every round)
        # is reused by the timed run
        self.llm.generate(groups[0], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = [o for g in groups for o in self.llm.generate(g, params, use_tqdm=False)]
        secs = time.perf_counter() - t0
        return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": secs}


class LlamaCppPeer:
    def __init__(self, model: str) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=model, n_ctx=2048, verbose=False, seed=0)
        self.eos = self.llm.token_eos()

    def _one(self, prompt: list[int], new: int, eos: bool) -> int:
        n = 0
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n >= new or (eos and tok == self.eos):
                break
        return n

    def run(self, prompts: list[list[int]], new: int, eos: bool, batch: int) -> dict:
        self._one(prompts[0], 4, False)  # warm-up
        t0 = time.perf_counter()
        tokens = sum(self._one(p, new, eos) for p in prompts)  # one request after another
        return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["vllm", "llamacpp"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        peer = VllmPeer(args.model, args.eager) if args.engine == "vllm" else LlamaCppPeer(args.model)
    except Exception as exc:  # reported to the benchmark, which prints it as this peer's result
        _say({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})
        return
    _say({"ready": True, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            _say(peer.run(req["prompts"], int(req["new"]), bool(req["eos"]), int(req.get("batch", 32))))
        except Exception as exc:
            _say({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    main()
