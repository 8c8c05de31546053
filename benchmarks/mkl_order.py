"""The order in which this CPU's MKL sums a linear layer's products, found by probing (FPRev's idea):
with the input all ones and one weight row holding +2^40 at position i, -2^40 at j and ones
elsewhere, every one summed into i's or j's partial sum before the two meet is absorbed, so the
output is K minus the size of the smallest partial sum holding both. One F.linear call probes a
pair per output row. The script prints, for i = 0 and each j, that size, and names the pattern:

- one row: a sequential prefix of P products, then L lanes (what kernels/c/linear_rowdot.c
  reproduces; kernels/gemm.py ROWDOT_ORDERS lists the orders it tries);
- several rows: a chain per output in blocks of kc products, the blocks then added in turn.

Whether products are fused with their sums (fma) is found by comparing on random data.

    python benchmarks/mkl_order.py [--k 576 1536] [--rows 1 8 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

BIG = 2.0 ** 40  # ulp(2^40) in float32 is 2^17: any partial sum of at most 2^16 ones is absorbed


def lca_sizes(k: int, rows: int, i: int = 0) -> list[int]:
    """Size of the smallest partial sum holding products i and j, for every j (j = i gives 0)."""
    w = torch.ones(k, k)
    for j in range(k):
        if j != i:
            w[j, i], w[j, j] = BIG, -BIG
    y = F.linear(torch.ones(rows, k), w)
    first = y[0]
    if not all(torch.equal(first, r) for r in y):
        raise SystemExit(f"rows of a {rows}-row call were summed in different orders: not one pattern")
    return [k - int(v) for v in first.tolist()]


def describe(sizes: list[int], k: int) -> str:
    chain = next((j for j in range(1, k) if sizes[j] != j + 1), k)  # j = 1.. joined one by one
    if chain == k:
        return "one sequential chain over all products"
    if sizes[chain] in (k, k // 2 + 1, k // 2):  # the next product is in another lane
        lanes = next(d for d in range(1, k) if sizes[chain - 1 + d] == sizes[chain - 1] + 1)
        return f"a prefix of {chain - 1} products one by one into lane 0, then {lanes} lanes"
    block = sizes[chain]
    return f"a chain in blocks of {chain} products, the blocks added in turn (next partial sum: {block})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[576, 1536])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads")
    for k in args.k:
        for rows in args.rows:
            sizes = lca_sizes(k, rows)
            print(f"K={k} rows={rows}: {describe(sizes, k)}; sizes for j=1..24: {sizes[1:25]}")


if __name__ == "__main__":
    main()
