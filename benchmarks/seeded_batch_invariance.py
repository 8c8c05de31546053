"""Seeded batch invariance: does a seeded request sample the same tokens alone as inside a batch?

Each seeded request draws its uniforms from its own generator, so the only way its output can change
with its batch companions is through the logits themselves: a batched forward (other rows in the
same matmuls, MIXED prefill+decode steps, different padding of the decode block) may move a logit in
its last bits, and an inverse-CDF draw that falls right on a boundary then picks the neighbour. This
measures how often that happens, on the same machine, model and parameters:

- `repeat`: the same batch composition run twice (must be 100%: the engine is deterministic);
- `alone vs batch`: each request alone, then together with 8 others (different prompts, prompt
  lengths and sampling parameters, all seeded, arriving together so prefill chunks and decodes mix).

Reported: the share of requests whose whole output is identical, and the share of output
positions generated before the first divergence (token-level match rate).

    python benchmarks/seeded_batch_invariance.py [--model smollm2] [--batch 9] [--rounds 2] [--new 32]
                                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = ["Write a short poem about the sea.", "Explain black holes to a child.", "List three uses of copper.",
           "Describe a rainy afternoon in Paris.", "What makes bread rise?", "Tell a story about a robot.",
           "Why is the sky blue?", "Give advice to a new gardener.", "Summarise the plot of Hamlet.",
           "How do trains stay on the rails?", "Write a haiku about winter.", "hi",
           "Name five rivers in Europe and say where each one flows, one sentence per river.",
           "Explain recursion with an example in Python.", "Describe the taste of coffee.",
           "Write a limerick about a cat.", "Translate 'good morning' to French, Spanish and German.",
           "What is 17 times 23?"]


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _params(i: int, new: int, seed: int):
    from workbench.engine.sample.sampling_params import SamplingParams

    # varied sampling parameters, so the batch mixes rows that take different paths through the stages
    return SamplingParams(temperature=0.7 + 0.05 * (i % 7), top_p=(0.9, 0.95, 1.0)[i % 3],
                          top_k=(-1, 50, 20)[i % 3], min_p=0.02 if i % 4 == 0 else 0.0, seed=seed,
                          max_new_tokens=new, ignore_eos=True)


def rates(xs: list[list[int]], ys: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(xs, ys))
    divergence = [_first_divergence(x, y) for x, y in zip(xs, ys)]
    return {"identical_requests": same, "requests": len(xs), "request_match_rate": same / len(xs),
            "token_match_rate": sum(divergence) / sum(len(x) for x in xs), "first_divergence": divergence}


def run(model: str, batch: int, new: int, rounds: int) -> dict:
    """Per round: `batch` seeded requests each run alone, then all together (each one inside a batch
    of `batch - 1` others), then all together again."""
    from workbench.engine.engine import Engine

    engine = Engine(model, trace_level="off")
    alone, batched, repeated = [], [], []
    t0 = time.perf_counter()
    for r in range(rounds):
        prompts = [_chat(PROMPTS[(r * batch + i) % len(PROMPTS)]) for i in range(batch)]
        params = [_params(i, new, seed=1000 * r + i) for i in range(batch)]
        alone += [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
        batched += [o.token_ids for o in engine.generate(prompts, params)]
        repeated += [o.token_ids for o in engine.generate(prompts, params)]
        print(f"round {r + 1}/{rounds} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return {"model": model, "new_tokens": new, "batch": batch, "rounds": rounds,
            "repeat_same_batch": rates(batched, repeated), "alone_vs_batch": rates(alone, batched),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=9, help="requests per batch (each has batch - 1 companions)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the result to this file")
    args = ap.parse_args()
    result = run(args.model, args.batch, args.new, args.rounds)
    rep, inv = result["repeat_same_batch"], result["alone_vs_batch"]
    print(f"model {result['model']}: {result['rounds']} rounds of {result['batch']} seeded requests x "
          f"{result['new_tokens']} tokens, {result['seconds']:.1f} s")
    print(f"same batch twice : {rep['identical_requests']}/{rep['requests']} identical, "
          f"token match {rep['token_match_rate']:.1%}")
    print(f"alone vs batch   : {inv['identical_requests']}/{inv['requests']} identical, "
          f"token match {inv['token_match_rate']:.1%} (first divergence at {inv['first_divergence']})")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
