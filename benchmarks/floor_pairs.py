"""Decode steps against the floor measured beside them: each pair reads the limit and runs steps
right after it, in one process, so both see the same moment of a shared machine.

    python benchmarks/floor_pairs.py [--model smollm2] [--batches 1 32] [--pairs 40] [--steps 1]

The read bandwidth and GEMM rate of these VMs move by a third within minutes (BENCHMARKS.md), so a
floor measured once, before or after a run, can be far from the one the steps met. Here every pair
measures its own:

- batch 1 against the bandwidth floor: the model's weights read in place (the one 2 MB-page mapping
  `to_huge_pages` made, the bytes a decode step reads) by `benchmarks/c/limits.c`'s read loop in
  the stream count and prefetch distance that were fastest at the start, the better of two reads;
- larger batches against the compute ceiling: the model's FLOP a token at MKL's float32 GEMM rate at
  256 rows (`limits.gemm_rate`), measured in the pair.

Then `--steps` decode steps (greedy chat requests, ignore_eos, exact mode, tracing off; one by
default: the VM's bandwidth moves within a block of several). A pair's fraction is its floor (or ceiling) time for one step over the median
step of its block; the table gives the median fraction over the pairs and their range. Decode
steps only: end to end figures (prefill included) are `benchmarks/throughput.py`'s.
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


def weights_span(model) -> tuple[int, int]:
    """(address, bytes) of the one mapping holding the model's parameters, as `to_huge_pages` laid
    them out; ValueError where they are not in one span (the weights were not moved)."""
    tensors = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    start = min(tensors)
    end = max(ptr + n for ptr, n in tensors.items())
    if end - start > 1.05 * sum(tensors.values()):
        raise ValueError("the weights are not in one mapping: load the model with huge_pages=True")
    return start, end - start


class WeightReader:
    """Reads the model's weights in place with the C read loop, in the fastest of its settings."""

    def __init__(self, model) -> None:
        import torch

        from benchmarks import limits

        self.lib = limits._read_lib()
        if self.lib is None:
            raise RuntimeError("benchmarks/c/limits.c did not build: no C compiler")
        self.ptr, self.nbytes = weights_span(model)
        self.threads = torch.get_num_threads()
        timings = {}
        for streams in (4, 8):
            for ahead in (0, 256):
                self.settings = (streams, ahead)
                self.seconds()
                timings[streams, ahead] = min(self.seconds() for _ in range(3))
        self.settings = min(timings, key=timings.get)

    def seconds(self) -> float:
        streams, ahead = self.settings
        t = time.perf_counter()
        self.lib.wb_read_streams(self.ptr, self.nbytes // 4, streams, ahead, self.threads)
        return time.perf_counter() - t


def measure(loaded, batch: int, pairs: int, steps: int, reader: WeightReader) -> dict[str, object]:
    from benchmarks import limits
    from benchmarks.step_profile import decoding_engine

    weight_bytes, flop = limits.model_costs(loaded.model)
    engine = decoding_engine(loaded, batch, new=pairs * steps + 16)
    for _ in range(3):  # warm: first-use checks done
        engine.step()
    fractions, step_ms, floor_ms, rates = [], [], [], []
    for _ in range(pairs):
        if batch == 1:
            span_s = min(reader.seconds(), reader.seconds())
            rate = reader.nbytes / span_s  # bytes a second
            floor = weight_bytes / rate
        else:
            rate = limits.gemm_rate(loaded.model, 256) * 1e9  # FLOP a second
            floor = batch * flop / rate
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        step = statistics.median(walls)
        fractions.append(floor / step)
        step_ms.append(step * 1e3)
        floor_ms.append(floor * 1e3)
        rates.append(rate / 1e9)
    engine.close()
    return {"fraction": statistics.median(fractions), "low": min(fractions), "high": max(fractions),
            "step": statistics.median(step_ms), "floor": statistics.median(floor_ms),
            "rate_low": min(rates), "rate_high": max(rates)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1, help="decode steps a pair")
    from benchmarks import limits

    limits.add_isa_argument(ap)
    args = ap.parse_args()
    for name in ("pairs", "steps"):
        if not 1 <= getattr(args, name) <= 200:
            ap.error(f"--{name} must be in [1, 200], got {getattr(args, name)}")
    if args.pairs * args.steps > 400:  # each request's KV holds 600 tokens (step_profile.decoding_engine)
        ap.error(f"--pairs x --steps must be at most 400, got {args.pairs} x {args.steps}")
    if any(not 1 <= b <= 256 for b in args.batches):
        ap.error(f"--batches must each be in [1, 256], got {args.batches}")
    limits.run_capped(args.isa)
    import torch

    from benchmarks.throughput import cpu_flags, cpu_model
    from workbench.models import load_model
    from workbench.server.heap import freeze_startup_heap

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    freeze_startup_heap()  # as `workbench serve` does: see server/heap.py
    reader = WeightReader(loaded.model)
    rows = {}
    for batch in args.batches:
        print(f"batch {batch}: {args.pairs} pairs of a floor reading and {args.steps} decode steps...",
              file=sys.stderr, flush=True)
        rows[batch] = measure(loaded, batch, args.pairs, args.steps, reader)
    load = os.getloadavg()[0]
    print(f"\n{args.model} float32 on {cpu_model()} ({cpu_flags()}){limits.isa_label()}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}, load average {load:.2f} at the end; "
          f"the read loop at {reader.settings[0]} streams a thread, prefetch {reader.settings[1]}\n")
    print("| batch | against | decode step (ms, median) | its floor (ms, median) | fraction, median pair (range) "
          "| rate in the pairs |")
    print("|---:|---|---:|---:|---|---|")
    for batch, r in rows.items():
        against, unit = ("the weights read at the read loop's rate", "GB/s") if batch == 1 else \
            ("the FLOP at MKL's 256-row rate", "GFLOP/s")
        print(f"| {batch} | {against} | {r['step']:.2f} | {r['floor']:.2f} | **{r['fraction']:.0%}** "
              f"({r['low']:.0%}-{r['high']:.0%}) | {r['rate_low']:.1f}-{r['rate_high']:.1f} {unit} |")


if __name__ == "__main__":
    main()
