"""What tracing at level summary costs a decode step, measured inside one engine: blocks of steps
with the trace on and off in turn, on the same running batch, so both sides see the same requests,
KV lengths and moment of a shared machine.

    python benchmarks/trace_cost.py [--model smollm2] [--batches 1 32] [--blocks 20] [--steps N]
        [--sinks file memory]

Each batch size starts that many greedy chat requests (ignore_eos), runs until all of them decode,
then alternates blocks of `--steps` steps (default: 16 below batch 8, 4 from it, so that a block
lasts about a third of a second): tracing off, then on (the next pair in the other order).
A block with tracing on ends with the writer's flush, so the trace file's writing counts against
it. `file` traces to a .wbtrace file (what `--trace` does: the trace writer's thread encodes and
commits every event); `memory` keeps the events in a list, which is the engine's own cost of
tracing (the sampler's vocabulary passes, the observer) without the writer's.

Prints per batch size and sink: the median step with tracing off and on and their ratio, and the
median of the paired ratios (each traced block against the untraced block beside it) with their
range. On a shared VM one pair can be 10% apart either way (memory bandwidth moves within
seconds), so the default is 20 pairs and both ratios are shown. End to end figures (prefill
included) come from `benchmarks/throughput.py`'s "engine (trace summary)" row.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(loaded, batch: int, blocks: int, steps: int, sink: str, folder: str) -> dict[str, object]:
    from benchmarks.step_profile import decoding_engine
    from workbench.trace.recorder import MemorySink
    from workbench.trace.store import TraceWriter

    engine = decoding_engine(loaded, batch, new=2 * blocks * steps + 16, trace_level="summary")
    for existing in list(engine.tracer.sinks):
        engine.tracer.remove_sink(existing)
    target = TraceWriter(os.path.join(folder, f"b{batch}-{sink}.wbtrace")) if sink == "file" else MemorySink()
    for _ in range(3):  # every request decoding, first-use checks done
        engine.step()
    off, on = [], []
    for pair in range(blocks):
        for traced in (False, True) if pair % 2 == 0 else (True, False):
            if traced:
                engine.tracer.add_sink(target)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            if traced:
                target.flush()
                engine.tracer.remove_sink(target)
            (on if traced else off).append((time.perf_counter() - start) / steps)
    target.close()
    engine.close()
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    return {"off": statistics.median(off), "on": statistics.median(on), "ratio": statistics.median(ratios),
            "low": min(ratios), "high": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--blocks", type=int, default=20, help="pairs of blocks (one off, one on) per batch size")
    ap.add_argument("--steps", type=int, default=0, help="decode steps per block (default: 16 below batch 8, else 4)")
    ap.add_argument("--sinks", nargs="+", default=["file", "memory"], choices=["file", "memory"])
    args = ap.parse_args()
    for name, value in (("--blocks", args.blocks), ("--steps", args.steps or 1)):
        if not 1 <= value <= 1000:
            ap.error(f"{name} must be in [1, 1000], got {value}")
    os.environ.setdefault("WORKBENCH_REPLACEMENTS", "fresh")
    import torch

    from workbench.models import load_model
    from workbench.server.heap import freeze_startup_heap

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    freeze_startup_heap()  # as `workbench serve` does: see server/heap.py
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for batch in args.batches:
            for sink in args.sinks:
                steps = args.steps or (16 if batch < 8 else 4)
                if 2 * args.blocks * steps > 4000:  # each request decodes them all: stay well inside the context
                    ap.error(f"--blocks x steps per block must be at most 2000, got {args.blocks} x {steps}")
                print(f"batch {batch}, {sink}: {args.blocks} pairs of {steps}-step blocks...", file=sys.stderr, flush=True)
                rows.append((batch, sink, measure(loaded, batch, args.blocks, steps, sink, folder)))
    load = os.getloadavg()
    print(f"\nTracing at summary, in one engine ({args.model}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average {load[0]:.2f} at the end):\n")
    print("| batch | trace to | step, off (ms) | step, summary (ms) | medians' ratio | summary / off, median pair "
          "(range) |")
    print("|---:|---|---:|---:|---:|---|")
    for batch, sink, r in rows:
        print(f"| {batch} | {sink} | {r['off'] * 1e3:.2f} | {r['on'] * 1e3:.2f} | {r['on'] / r['off']:.3f}x | "
              f"**{r['ratio']:.3f}x** ({r['low']:.3f}-{r['high']:.3f}) |")


if __name__ == "__main__":
    main()
