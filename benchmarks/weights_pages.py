"""What holding the weights in 2 MB huge pages (models/loader.py `to_huge_pages`) does to a decode
step: two engines on the same model, one loaded with `huge_pages=False` (safetensors' file
mapping, 4 KB pages), one as `load_model` loads by default, stepping in alternate blocks on the
same greedy chat requests, so both see the same KV lengths and moment of a shared machine.

    python benchmarks/weights_pages.py [--model smollm2] [--batches 1 32] [--blocks 16]

Prints per batch size the median step of each and the median of the paired ratios (range), and
checks that both engines produced the same tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _block(engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--blocks", type=int, default=16, help="pairs of blocks per batch size")
    args = ap.parse_args()
    if not 1 <= args.blocks <= 60:
        ap.error(f"--blocks must be in [1, 60], got {args.blocks}")
    os.environ.setdefault("WORKBENCH_REPLACEMENTS", "fresh")
    import torch

    from benchmarks.step_profile import decoding_engine
    from workbench.models import load_model
    from workbench.models.loader import huge_pages_available

    if not huge_pages_available():
        sys.exit("this system offers no transparent huge pages (Linux with THP not `never`): nothing to compare")
    small = load_model(args.model, device="cpu")
    huge = load_model(args.model, device="cpu", huge_pages=True)
    rows = []
    for batch in args.batches:
        steps = 16 if batch < 8 else 4
        print(f"batch {batch}: {args.blocks} pairs of {steps}-step blocks...", file=sys.stderr, flush=True)
        engines = {name: decoding_engine(lm, batch, new=2 * args.blocks * steps + 16, trace_level="off")
                   for name, lm in (("4 KB", small), ("2 MB", huge))}
        for engine in engines.values():
            for _ in range(3):
                engine.step()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for pair in range(args.blocks):
            for name in (("4 KB", "2 MB") if pair % 2 == 0 else ("2 MB", "4 KB")):
                times[name].append(_block(engines[name], steps))
        outputs = [[list(r.output_ids) for r in e.scheduler.running] for e in engines.values()]
        ratios = [h / s for h, s in zip(times["2 MB"], times["4 KB"], strict=True)]
        rows.append((batch, statistics.median(times["4 KB"]), statistics.median(times["2 MB"]),
                     statistics.median(ratios), min(ratios), max(ratios), outputs[0] == outputs[1]))
        for engine in engines.values():
            engine.close()
    load = os.getloadavg()
    print(f"\nWeights in 4 KB pages against 2 MB pages ({args.model}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average {load[0]:.2f} at the end):\n")
    print("| batch | step, 4 KB pages (ms) | step, 2 MB pages (ms) | 2 MB / 4 KB, median pair (range) | same tokens |")
    print("|---:|---:|---:|---|---|")
    for batch, small_ms, huge_ms, ratio, low, high, same in rows:
        print(f"| {batch} | {small_ms * 1e3:.2f} | {huge_ms * 1e3:.2f} | **{ratio:.3f}x** ({low:.3f}-{high:.3f}) | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
