"""Is a refactor behaviour-neutral? Record the same workloads with two source trees and compare every
trace event, field by field, ignoring only wall-clock times.

    python benchmarks/events_before_after.py --before REV [--after WORKTREE_OR_REV] [--model smollm2]

`--before` and `--after` are git revisions (checked out into temporary worktrees) or folders holding a
checkout. Each tree records the workloads below in its own interpreter (PYTHONPATH = that tree), so
both run the code as committed. Prints, per workload, the number of events and the first difference
(step, request, kind, field) or "identical"; exits 1 if any workload differs.

The workloads touch every stage: greedy and seeded sampling in one batch, a stop string, logprobs
with top alternatives, n > 1, chunked prefill with MIXED batches, the prefix cache, and speculative
decoding (n-gram drafts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECORD = r'''
import json, sys
from workbench import Engine, SamplingParams
model, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
chats = [[{"role": "user", "content": "List three fruits, one per line."}],
         [{"role": "user", "content": "Write a haiku about the sea."}],
         "The capital of France is", "def fibonacci(n):"]
greedy = SamplingParams(temperature=0, max_new_tokens=24, logprobs=True, top_logprobs=5)
seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_new_tokens=24)
stopped = SamplingParams(temperature=0, max_new_tokens=32, stop=["\n2"])
many = SamplingParams(temperature=0.7, seed=5, n=2, max_new_tokens=12)
settings = {"batch": {}, "chunked": {"chunk_size": 8, "max_batch_tokens": 24},
            "prefix_cache": {"prefix_cache": True}, "speculative": {"spec": "ngram:k=4"}}[name]
with Engine(model, trace=out, trace_level="summary", **settings) as engine:
    engine.generate(chats, [greedy, seeded, stopped, many])
    if name == "prefix_cache":
        engine.generate(chats[:2], [greedy, seeded])
'''
WORKLOADS = ("batch", "chunked", "prefix_cache", "speculative")
TIME_KEYS = {"t", "time", "elapsed", "elapsed_ms", "ms", "seconds", "duration", "wall"}


def _tree(spec: str, tmp: Path, label: str) -> Path:
    if Path(spec).is_dir():
        return Path(spec).resolve()
    dest = tmp / label
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dest), spec], check=True,
                   capture_output=True)
    return dest


def _record(tree: Path, model: str, name: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", RECORD, model, str(out), name], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"recording {name} with {tree} failed:\n{done.stderr[-3000:]}")


def _timeless(value):
    if isinstance(value, dict):
        kept = {k: _timeless(v) for k, v in value.items() if k not in TIME_KEYS and not k.endswith(("_t", "_ms", "_s"))}
        if isinstance(kept.get("timings"), dict):  # a finished request's latencies: only the count is not a time
            kept["timings"] = {"preemptions": kept["timings"].get("preemptions")}
        return kept
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def _events(path: Path) -> list[dict]:
    from workbench.trace.reader import open_trace

    with open_trace(str(path)) as trace:
        return [_timeless(json.loads(json.dumps(e.to_json() if hasattr(e, "to_json") else e.__dict__, default=str)))
                for e in trace.events() if type(e).__name__ != "Stamp"]


def _first_difference(a: list[dict], b: list[dict]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            return (f"event {i} (step {x.get('step')}, {x.get('req_id')}, {x.get('kind', type(x).__name__)}): "
                    f"fields {keys}")
    return None if len(a) == len(b) else f"{len(a)} vs {len(b)} events"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a git revision or a checkout folder")
    ap.add_argument("--after", default=str(ROOT), help="a git revision or a checkout folder (default: this one)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep the traces of a workload that differs here")
    args = ap.parse_args()
    differ = 0
    with tempfile.TemporaryDirectory(prefix="events-before-after-") as tmp:
        tmp_path = Path(tmp)
        trees = {"before": _tree(args.before, tmp_path, "before"), "after": _tree(args.after, tmp_path, "after")}
        try:
            for name in WORKLOADS:
                events = {}
                for label, tree in trees.items():
                    out = tmp_path / f"{label}-{name}.wbtrace"
                    print(f"recording {name} with {label} ...", file=sys.stderr, flush=True)
                    _record(tree, args.model, name, out)
                    events[label] = _events(out)
                diff = _first_difference(events["before"], events["after"])
                if diff is not None and args.keep:
                    for label in trees:
                        Path(args.keep).mkdir(parents=True, exist_ok=True)
                        (tmp_path / f"{label}-{name}.wbtrace").replace(Path(args.keep) / f"{label}-{name}.wbtrace")
                differ += diff is not None
                print(f"{name:>13}: {len(events['before'])} events  {diff or 'identical (times ignored)'}")
        finally:
            for tree in trees.values():
                if str(tree).startswith(str(tmp_path)):
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
