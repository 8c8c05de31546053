"""A/B throughput of two source trees of the engine, in alternating rounds (same workload, same machine).

    python benchmarks/engine_ab.py --a /path/to/old/checkout --b . [--prompts 16 --new 64 --rounds 4]

Each run is its own process with that tree first on `sys.path` (so each imports its own `workbench`)
and times `benchmarks/throughput.py`'s engine run of that tree (untraced unless `--trace-a` / `--trace-b`
say otherwise: `--a . --b . --trace-b summary` is what tracing costs). Rounds alternate A B, B A,
... so a burst of load on a shared machine hits both; the result is the median of the per-round
ratios B / A (above 1: B is faster; `--kernels-b fast`: the fast mode against exact), by wall clock and by the process's CPU time (tokens per
CPU-second, one thread by default: what a loaded machine distorts least). Use it for "throughput unchanged by a refactor" claims.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = """
import json, sys
sys.path.insert(0, {tree!r})
from benchmarks.throughput import bench_engine, chat_prompts
from workbench.models import load_model
import workbench
assert workbench.__file__.startswith({tree!r}), workbench.__file__
import time
loaded = load_model({model!r}, device="cpu", huge_pages=True)
cpu = time.process_time()
r = bench_engine(loaded, chat_prompts({prompts}), {new}, trace_level={trace!r}, **{extra!r})
r["cpu_s"] = time.process_time() - cpu  # includes the engine's set-up and a 2-prompt warm-up
print(json.dumps(r))
"""


def run(tree: Path, args: argparse.Namespace, trace: str = "off", kernels: str = "exact") -> dict[str, float]:
    extra = {} if kernels == "exact" else {"kernels": kernels}  # a tree from before the mode takes no kernels=
    code = RUN.format(tree=str(tree), model=args.model, prompts=args.prompts, new=args.new, trace=trace, extra=extra)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false",
                              "OMP_NUM_THREADS": str(args.threads)})
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the run failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tok_s": r["tok_s"], "cpu_tok_s": r["tokens"] / r["cpu_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, type=Path, help="baseline source tree")
    ap.add_argument("--b", required=True, type=Path, help="candidate source tree")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (1: CPU time is"
                    " one thread's work, which a loaded machine distorts least)")
    ap.add_argument("--trace-a", default="off", choices=["off", "summary", "full"], help="A's trace level")
    ap.add_argument("--trace-b", default="off", choices=["off", "summary", "full"],
                    help="B's trace level (--a . --b . --trace-b summary: what tracing costs)")
    ap.add_argument("--kernels-a", default="exact", choices=["exact", "fast", "fast-int8"], help="A's numerics mode")
    ap.add_argument("--kernels-b", default="exact", choices=["exact", "fast", "fast-int8"],
                    help="B's numerics mode (--a . --b . --kernels-b fast: what the fast mode buys)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    a_tree, b_tree = args.a.resolve(), args.b.resolve()
    rounds = []
    for i in range(args.rounds):
        order = [("a", a_tree), ("b", b_tree)] if i % 2 == 0 else [("b", b_tree), ("a", a_tree)]
        r = {name: run(tree, args, args.trace_a if name == "a" else args.trace_b,
                       args.kernels_a if name == "a" else args.kernels_b) for name, tree in order}
        rounds.append(r)
        a, b = r["a"], r["b"]
        print(f"round {i + 1}: wall A {a['tok_s']:7.1f} B {b['tok_s']:7.1f} tok/s (B/A {b['tok_s'] / a['tok_s']:.3f}); "
              f"CPU A {a['cpu_tok_s']:7.1f} B {b['cpu_tok_s']:7.1f} tok/CPU-s (B/A "
              f"{b['cpu_tok_s'] / a['cpu_tok_s']:.3f})", flush=True)
    ratio = statistics.median(r["b"]["tok_s"] / r["a"]["tok_s"] for r in rounds)
    cpu_ratio = statistics.median(r["b"]["cpu_tok_s"] / r["a"]["cpu_tok_s"] for r in rounds)
    print(f"median same-round ratio B/A over {args.rounds} rounds: wall {ratio:.3f}, CPU time {cpu_ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "rounds": rounds, "median_ratio": ratio,
                                               "median_cpu_ratio": cpu_ratio}, indent=1))


if __name__ == "__main__":
    main()
