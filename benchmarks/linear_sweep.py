"""Every linear layer of SmolLM2 once, as one decode step calls them (211 distinct weights, so they
come from memory rather than cache, as in the engine), through each GEMM kernel exact mode can race:
F.linear, the split GEMM, the one-row C kernel (`linear.rowdot`) at one row and the blocked C kernel
(`linear.blocked`) at several. Each kernel runs in its checked order; the check itself is not run
here (kernels/gemm.py and the engine do that), so on a CPU where a kernel's order is not MKL's its
time is still shown but the engine would not use it. Best of 5 passes, per round.

    python benchmarks/linear_sweep.py [--rows 1 8 32] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]  # (out, in) of one layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.engine.kernels import Book, gemm

    lins = [torch.nn.Linear(i, o, bias=False) for _ in range(30) for o, i in SHAPES]
    lins.append(torch.nn.Linear(576, 49152, bias=False))
    packs = [gemm.PackedLinear(gemm.mkl(), m, Book()) for m in lins]
    for p in packs:
        p.rowdot_order = gemm.ROWDOT_ORDERS[0]
    weight_bytes = sum(m.weight.numel() * 4 for m in lins)
    flop_per_row = sum(2 * m.weight.numel() for m in lins)

    def sweep(kind: str, rows: int) -> float:
        xs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        for p in packs:
            p.blocked_orders[rows] = gemm.BLOCKED_ORDERS[0]
        run = {"F.linear": lambda p, m, x: F.linear(x, m.weight), "split": lambda p, m, x: p.split_compute(x),
               "rowdot": lambda p, m, x: p.rowdot_compute(x), "blocked": lambda p, m, x: p.blocked_compute(x)}[kind]

        def once() -> None:
            for p, m in zip(packs, lins, strict=True):
                run(p, m, xs[m.in_features])

        with torch.inference_mode():
            once()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                once()
                best = min(best, time.perf_counter() - t)
        return best

    print(f"{len(lins)} linears, {weight_bytes / 1e6:.0f} MB of float32 weights, {args.threads} threads")
    print("| rows | round | kernel | ms | GFLOP/s | GB/s of weights |\n|---:|---:|---|---:|---:|---:|")
    for rows in args.rows:
        kinds = ["F.linear", "split", "rowdot" if rows == 1 else "blocked"]
        for rnd in range(args.rounds):
            for kind in kinds:
                t = sweep(kind, rows)
                print(f"| {rows} | {rnd + 1} | {kind} | {t * 1e3:.1f} | {flop_per_row * rows / t / 1e9:.1f} | "
                      f"{weight_bytes / t / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
