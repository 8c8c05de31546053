"""One GEMM of each SmolLM2 shape, per kernel the fast mode could use: `F.linear` (fp32, what exact
mode runs below 16 rows and where the packed verdict refuses), MKL's packed fp32 sgemm (exact
mode's fast path, used everywhere by lever (a) "packed regardless of the verdict"), bf16
`F.linear` (kernels="fast") and torch's weight-only int8 GEMM with bf16 / fp32 inputs
(kernels="fast-int8" at <= 8 rows). Milliseconds per call, best of 3 x 20 calls, the same weight
every call (cache-hot: the per-layer weights fit in L2/L3; the 49152-row lm_head does not).

    python benchmarks/fast_linear.py [--threads 1] [--rows 1 8 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out, in): q/o, k/v, gate/up, down, lm_head


def _time(fn, n: int = 20) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.engine.kernels import native
    from workbench.engine.run import fastmode

    lib = native.mkl()
    print(f"native bf16: {fastmode.cpu_has_bf16()}, {args.threads} thread(s)")
    print("| rows | out x in | F.linear fp32 | packed fp32 | bf16 | int8 (fp32 in) | int8 (bf16 in) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for n, k in SHAPES:
            print(f"| {rows} | {n}x{k} | " + " | ".join(f"{c:.3f}" for c in _row(lib, rows, n, k)) + " |")


def _row(lib, rows: int, n: int, k: int) -> list[float]:
    from workbench.engine.kernels import gemm
    from workbench.engine.run import fastmode

    m = torch.nn.Linear(k, n, bias=False)
    w, x = m.weight.detach(), torch.randn(rows, k)
    packed = gemm.PackedLinear(lib, m) if lib is not None else None
    w16, x16 = w.to(torch.bfloat16), x.to(torch.bfloat16)
    q, scale = fastmode.quantize_int8(w)
    with torch.inference_mode():
        return [_time(lambda: F.linear(x, w)),
                _time(lambda: packed.compute(x)) if packed is not None else float("nan"),
                _time(lambda: F.linear(x16, w16)),
                _time(lambda: torch._weight_int8pack_mm(x, q, scale.float())),
                _time(lambda: torch._weight_int8pack_mm(x16, q, scale))]


if __name__ == "__main__":
    main()
