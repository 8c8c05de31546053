"""A/B throughput of two source trees of the engine, in alternating rounds (same workload, same machine).

    python benchmarks/engine_ab.py --a /path/to/old/checkout --b . [--prompts 16 --new 64 --rounds 4]

Each run is its own process with that tree first on `sys.path` (so each imports its own `workbench`)
and times `benchmarks/throughput.py`'s untraced engine run of that tree. Rounds alternate A B, B A,
... so a burst of load on a shared machine hits both; the result is the median of the per-round
ratios B / A (above 1: B is faster). Use it for "throughput unchanged by a refactor" claims.
"""

from __future__ import annotations

import argparse
import json
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
loaded = load_model({model!r}, device="cpu")
print(json.dumps(bench_engine(loaded, chat_prompts({prompts}), {new})))
"""


def run(tree: Path, args: argparse.Namespace) -> float:
    code = RUN.format(tree=str(tree), model=args.model, prompts=args.prompts, new=args.new)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"})
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, type=Path, help="baseline source tree")
    ap.add_argument("--b", required=True, type=Path, help="candidate source tree")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    a_tree, b_tree = args.a.resolve(), args.b.resolve()
    rounds = []
    for i in range(args.rounds):
        order = [("a", a_tree), ("b", b_tree)] if i % 2 == 0 else [("b", b_tree), ("a", a_tree)]
        r = {name: run(tree, args) for name, tree in order}
        rounds.append(r)
        print(f"round {i + 1}: A {r['a']:7.1f} tok/s   B {r['b']:7.1f} tok/s   B/A {r['b'] / r['a']:.3f}", flush=True)
    ratio = statistics.median(r["b"] / r["a"] for r in rounds)
    print(f"median same-round ratio B/A over {args.rounds} rounds: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "rounds": rounds, "median_ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
