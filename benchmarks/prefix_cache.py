"""Multi-turn chat with and without the prefix cache: prefill tokens computed, TTFT and time per turn.

`--convs` conversations (one long system prompt, different questions) advance in lockstep for
`--turns` turns: every turn, each conversation sends its whole history plus a new user message, all
conversations in one `generate` call, greedy, up to `--new` tokens (stopping at EOS). The same run
goes through an engine with `prefix_cache=True` and one without (prefix sharing on in both: the
system prompt is shared in flight either way), alternating `--repeat` times; the best time of each
turn is kept. The outputs must be identical token for token (the script counts mismatches).

    python benchmarks/prefix_cache.py [--model smollm2] [--convs 8] [--turns 4] [--new 48] [--repeat 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm.auto import tqdm  # noqa: E402

from workbench.engine.engine import Engine  # noqa: E402
from workbench.engine.sample.sampling_params import SamplingParams  # noqa: E402
from workbench.models import load_model  # noqa: E402

SYSTEM = ("You are a patient tutor for engineers who build LLM inference engines. Answer precisely, in plain "
          "words, and say when something depends on the hardware. Prefer short paragraphs and concrete numbers.")
QUESTIONS = ["What is a KV cache?", "Why does batching help decode throughput?", "What is chunked prefill?",
             "How does speculative decoding stay exact?", "What does top-p sampling cut?",
             "Why do logprobs differ between engines?", "What is continuous batching?", "What is paged attention?"]
FOLLOW_UPS = ["Give a concrete example.", "What goes wrong at scale?", "How would I measure it?",
              "Summarise that in one sentence.", "What is a common misconception?"]


def run(loaded, args, prefix_cache: bool) -> dict:
    engine = Engine(loaded, trace_level="off", prefix_cache=prefix_cache)
    params = SamplingParams(temperature=0, max_new_tokens=args.new)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
             for i in range(args.convs)]
    turns, tokens = [], []
    for t in range(args.turns):
        start = time.perf_counter()
        outs = engine.generate(chats, params)
        wall = time.perf_counter() - start
        turns.append({"turn": t + 1, "seconds": wall,
                      "prompt_tokens": sum(o.usage["prompt_tokens"] for o in outs),
                      "cached_tokens": sum(o.usage["cached_prompt_tokens"] for o in outs),
                      "ttft_ms": 1000 * statistics.median(o.timings["ttft"] for o in outs),
                      "output_tokens": sum(len(o.token_ids) for o in outs)})
        tokens.append([o.token_ids for o in outs])
        for chat, out in zip(chats, outs, strict=True):
            chat += [{"role": "assistant", "content": out.text},
                     {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    stats = engine.scheduler.prefix_cache.stats() if prefix_cache else None
    engine.close()
    return {"turns": turns, "tokens": tokens, "cache": stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model, huge_pages=True)
    best: dict[bool, list[dict]] = {}
    tokens: dict[bool, list] = {}
    caches = []
    with tqdm(total=2 * args.repeat, desc="benchmarks", unit="run") as bar:
        for _ in range(args.repeat):
            for cache in (True, False):
                res = run(loaded, args, cache)
                tokens[cache] = res["tokens"]
                if res["cache"]:
                    caches.append(res["cache"])
                prev = best.get(cache)
                best[cache] = res["turns"] if prev is None else [
                    a if a["seconds"] <= b["seconds"] else b for a, b in zip(prev, res["turns"], strict=True)]
                bar.update(1)
    mismatches = sum(a != b for ta, tb in zip(tokens[True], tokens[False], strict=True) for a, b in zip(ta, tb))
    lines = ["| turn | prompt tokens | cached with / without the cache | computed with / without | "
             "median TTFT with / without (ms) | turn time with / without (s) |", "|---|---:|---:|---:|---:|---:|"]
    for a, b in zip(best[True], best[False], strict=True):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} / {b['cached_tokens']} | "
                     f"{a['prompt_tokens'] - a['cached_tokens']} / {b['prompt_tokens'] - b['cached_tokens']} | "
                     f"{a['ttft_ms']:.0f} / {b['ttft_ms']:.0f} | {a['seconds']:.2f} / {b['seconds']:.2f} |")
    total = sum(t["seconds"] for t in best[True]), sum(t["seconds"] for t in best[False])
    text = (f"`python benchmarks/prefix_cache.py` — {args.model}, {args.convs} conversations × {args.turns} turns, "
            f"greedy, up to {args.new} new tokens a turn; {platform.machine()}, {loaded.device}, "
            f"{time.strftime('%Y-%m-%d')}; best of {args.repeat} alternating runs per turn.\n\n" + "\n".join(lines) +
            f"\n\nAll turns: {total[0]:.2f} s with the cache, {total[1]:.2f} s without ({total[1] / total[0]:.2f}x). "
            f"Outputs differing between the two: {mismatches} of {args.convs * args.turns}. "
            f"Cache after a run: {caches[-1] if caches else '-'}.")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "with": best[True], "without": best[False],
                                               "mismatches": mismatches, "cache": caches}, indent=1))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
