"""What capture inside the forward pass costs (issue 18), measured in alternating rounds.

    python benchmarks/capture.py [--base-ref main --prompts 32 --new 32 --rounds 3 --json OUT]

1. Capture off: this tree's untraced engine against the same engine from `--base-ref` (extracted
   with `git archive` into a temporary folder), each run its own process (benchmarks/engine_ab.py),
   rounds alternating A B, B A: the median same-round ratio should be 1 (nothing runs when off).
2. Capture on for one request of a batch of `--prompts`: the same batch traced to a file at level
   summary with and without that one request captured (all four quantities, top-10 attention),
   alternating in one process; the overhead is the median same-round ratio, and the bytes per
   captured token are the stored tensors plus the capture events, over the captured positions.
The machine's load average is printed with the numbers: on a shared machine, say so with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_ab import run as run_tree  # noqa: E402
from benchmarks.throughput import chat_prompts  # noqa: E402


def extract(ref: str, into: Path) -> Path:
    """`git archive ref` unpacked into `into` (no worktree, nothing changed in the repository)."""
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def capture_off(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="capture-base-") as tmp:
        base = extract(args.base_ref, Path(tmp))
        ab = argparse.Namespace(model=args.model, prompts=args.prompts, new=args.new, threads=args.threads)
        rounds = []
        for i in range(args.rounds):
            order = [("base", base), ("this", ROOT)] if i % 2 == 0 else [("this", ROOT), ("base", base)]
            r = {name: run_tree(tree, ab) for name, tree in order}
            rounds.append(r)
            print(f"off round {i + 1}: {args.base_ref} {r['base']['tok_s']:.1f}  this {r['this']['tok_s']:.1f} tok/s "
                  f"(ratio {r['this']['tok_s'] / r['base']['tok_s']:.3f}; CPU ratio "
                  f"{r['this']['cpu_tok_s'] / r['base']['cpu_tok_s']:.3f})  load {os.getloadavg()[0]:.1f}", flush=True)
    return {"rounds": rounds,
            "median_ratio": statistics.median(r["this"]["tok_s"] / r["base"]["tok_s"] for r in rounds),
            "median_cpu_ratio": statistics.median(r["this"]["cpu_tok_s"] / r["base"]["cpu_tok_s"] for r in rounds)}


def one_run(loaded, prompts, new: int, capture: bool, path: str) -> dict:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    with Engine(loaded, trace=path, trace_level="summary", kv_tokens=64 * 1024) as engine:
        engine.generate(prompts[:2], params.replace(max_new_tokens=4))  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(prompts):
            engine.add_request(p, params, capture=capture and i == 0)
        tokens = 0
        while engine.has_work():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tok_s": tokens / wall, "cpu_tok_s": tokens / cpu, "tokens": tokens}


def stored_bytes(path: str) -> tuple[int, int, int]:
    """(tensor bytes, capture event bytes, captured positions) of a trace file."""
    with sqlite3.connect(path) as conn:
        tensors = conn.execute("SELECT coalesce(sum(length(data)), 0) FROM tensors").fetchone()[0]
        events, count = conn.execute("SELECT coalesce(sum(length(payload)), 0), count(*) FROM events "
                                     "WHERE kind = 'capture'").fetchone()
    return int(tensors), int(events), int(count)


def capture_on(args: argparse.Namespace) -> dict:
    from workbench.models import load_model

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    prompts = chat_prompts(args.prompts)
    rounds, sizes = [], None
    with tempfile.TemporaryDirectory(prefix="capture-on-") as tmp:
        for i in range(args.rounds):
            order = [False, True] if i % 2 == 0 else [True, False]
            r = {}
            for on in order:
                path = os.path.join(tmp, f"r{i}-{int(on)}.wbtrace")
                r["on" if on else "off"] = one_run(loaded, prompts, args.new, on, path)
                if on:
                    sizes = stored_bytes(path)
            rounds.append(r)
            print(f"on round {i + 1}: traced {r['off']['tok_s']:.1f}  +1 captured {r['on']['tok_s']:.1f} tok/s "
                  f"(ratio {r['on']['tok_s'] / r['off']['tok_s']:.3f}; CPU ratio "
                  f"{r['on']['cpu_tok_s'] / r['off']['cpu_tok_s']:.3f})  load {os.getloadavg()[0]:.1f}", flush=True)
    tensors, events, count = sizes
    return {"rounds": rounds,
            "median_ratio": statistics.median(r["on"]["tok_s"] / r["off"]["tok_s"] for r in rounds),
            "median_cpu_ratio": statistics.median(r["on"]["cpu_tok_s"] / r["off"]["cpu_tok_s"] for r in rounds),
            "captured_positions": count, "tensor_bytes_per_token": tensors / count,
            "event_bytes_per_token": events / count}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-ref", default="main", help="git ref of the engine to compare capture-off against")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the capture-off runs")
    ap.add_argument("--skip-off", action="store_true", help="only the capture-on part")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"args": vars(args), "load_before": os.getloadavg()}
    if not args.skip_off:
        result["off"] = capture_off(args)
        print(f"capture off vs {args.base_ref}: median same-round ratio {result['off']['median_ratio']:.3f} "
              f"(CPU time {result['off']['median_cpu_ratio']:.3f})")
    result["on"] = on = capture_on(args)
    print(f"one of {args.prompts} requests captured: median ratio {on['median_ratio']:.3f} "
          f"(CPU {on['median_cpu_ratio']:.3f}); {on['tensor_bytes_per_token'] / 1024:.1f} KiB of tensors + "
          f"{on['event_bytes_per_token'] / 1024:.1f} KiB of event per captured token "
          f"({on['captured_positions']} positions)")
    result["load_after"] = os.getloadavg()
    print(f"load average before {result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f} "
          f"({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
