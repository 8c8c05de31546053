"""Speculative decoding: acceptance and end-to-end speed-up versus no speculation, per drafter.

Two workloads on the same model and machine, in one run: `edit` (prompts that ask to repeat or edit
a given text, where the output copies the prompt and drafting should help) and `open` (open
questions and stories, where it should not). Greedy decoding with ignore_eos, so every run emits
the same number of tokens and the outputs must match the run without speculation token for token
(the script counts mismatches). Each drafter runs at every concurrency level asked for (1 = one
request at a time, the latency case; larger = that many requests batched).

    python benchmarks/spec_decode.py [--model smollm2] [--new 64] [--prompts 8] [--batch 1 8]
        [--spec ngram:k=4 early-exit:layers=26:k=2 draft:tiny-random:k=4] [--repeat 1] [--json out.json]

Acceptance numbers (rate, mean acceptance length) are summed over every repeat; speed is the
fastest repeat. On smollm2 only the random `tiny-random` shares the tokenizer, so the draft-model
row shows the cost of a useless drafter; `draft:smollm2` shows the opposite bound (everything
accepted, drafting as dear as verifying).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and wrote the "
    "weather in a leather notebook before the ships came past the rocks.",
    "To install the package, create a virtual environment, activate it, upgrade pip, and then run pip "
    "install with the name of the package and the version you need.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Honeybees visit thousands of flowers each day, carrying nectar back to the hive, where it is "
    "turned into honey and stored in wax cells for the winter.",
]
EDITS = ["Repeat the following text exactly:\n{}", "Rewrite the following text, replacing every 'the' with 'a':\n{}",
         "Fix any mistakes in the following text and return it in full:\n{}",
         "Copy the following text and add a title line above it:\n{}"]
OPEN = ["Write a short poem about the ocean.", "Explain black holes to a child.", "Tell a story about a robot "
        "learning to paint.", "What are three good habits for staying healthy?", "Describe a city at night.",
        "Why is the sky blue?", "Write a letter to a friend about your holiday.", "Invent a new board game."]


def workloads(n: int) -> dict[str, list]:
    edit = [[{"role": "user", "content": EDITS[i % len(EDITS)].format(PASSAGES[(i // len(EDITS) + i) % len(PASSAGES)])}]
            for i in range(n)]
    open_ = [[{"role": "user", "content": OPEN[i % len(OPEN)]}] for i in range(n)]
    return {"edit": edit, "open": open_}


def run(loaded, spec: str | None, prompts: list, new: int, batch: int, repeat: int = 1) -> dict:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine = Engine(loaded, trace_level="off", spec=spec)
    engine.generate(prompts[:1], params.replace(max_new_tokens=8))  # warm-up
    secs = float("inf")
    for _ in range(repeat):  # the fastest of `repeat` runs: the machine may be shared
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), batch):
            outs += engine.generate(prompts[i:i + batch], params)
        secs = min(secs, time.perf_counter() - t0)
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"spec": spec or "none", "tokens": tokens, "seconds": secs, "tok_s": tokens / secs,
              "repeat": repeat,
              "outputs": [o.token_ids for o in outs]}
    if engine.spec is not None:
        m = engine.spec.metrics()
        result.update(acceptance_rate=m["acceptance_rate"], mean_acceptance_length=m["mean_acceptance_length"],
                      acceptance_per_position=m["acceptance_per_position"], draft_s=m["draft_s"],
                      verify_s=m["verify_s"])
    engine.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="concurrency levels")
    ap.add_argument("--spec", nargs="+", default=["ngram:k=4", "early-exit:layers=26:k=2", "draft:tiny-random:k=4"])
    ap.add_argument("--repeat", type=int, default=1, help="time each configuration this many times, keep the fastest")
    ap.add_argument("--workload", nargs="+", default=["edit", "open"], choices=["edit", "open"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from workbench.models import load_model

    loaded = load_model(args.model, device=args.device, huge_pages=True)
    results = []
    print(f"{args.model} on {loaded.device} ({loaded.dtype}), torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.new} new tokens, {args.prompts} prompts per workload")
    print(f"{'workload':8} {'batch':>5} {'spec':28} {'tok/s':>8} {'speed-up':>8} {'accept':>7} {'mean len':>8} "
          f"{'same output':>11}")
    for name, prompts in workloads(args.prompts).items():
        if name not in args.workload:
            continue
        for batch in args.batch:
            base = run(loaded, None, prompts, args.new, batch, args.repeat)
            rows = [base] + [run(loaded, spec, prompts, args.new, batch, args.repeat) for spec in args.spec]
            for r in rows:
                r.update(workload=name, batch=batch, speedup=r["tok_s"] / base["tok_s"],
                         same_output=sum(a == b for a, b in zip(r["outputs"], base["outputs"])))
                acc = r.get("acceptance_rate")
                mlen = r.get("mean_acceptance_length")
                print(f"{name:8} {batch:>5} {r['spec']:28} {r['tok_s']:>8.1f} {r['speedup']:>7.2f}x "
                      f"{'-' if acc is None else f'{acc:.2f}':>7} {'-' if mlen is None else f'{mlen:.2f}':>8} "
                      f"{r['same_output']:>6}/{len(prompts)}", flush=True)
            results += rows
    if args.json:
        meta = {"model": args.model, "device": loaded.device, "dtype": loaded.dtype, "new": args.new,
                "prompts": args.prompts, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.machine(), "python": platform.python_version()}
        for r in results:
            r.pop("outputs")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
