"""How far a throughput figure is from what this machine allows, measured in the same run:

- the memory-bandwidth floor at batch 1: every decode step reads each weight matrix once, so a
  token takes at least (bytes of weights read per token) / (measured copy bandwidth);
- the compute ceiling batched: (the model's FLOP per token) / (measured float32 GEMM rate).

    python benchmarks/limits.py [--model smollm2]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(slots=True)
class Limits:
    weight_bytes_per_token: int  # every nn.Linear weight (lm_head included) read once per decode step
    flop_per_token: float  # 2 x multiply-adds of those GEMMs (attention over a short context is < 1% here)
    copy_gb_s: float  # bytes read + written per second by a large tensor copy
    gemm_gflop_s: float  # float32 GEMM at the model's shapes, 256 rows
    gemm32_gflop_s: float  # the same at 32 rows (a decode batch)

    @property
    def floor_tok_s(self) -> float:
        """Batch 1 can not beat this: the weights streamed from memory once per token, at the copy
        rate counted as STREAM does (bytes read + written), taken as the read rate."""
        return self.copy_gb_s * 1e9 / self.weight_bytes_per_token

    @property
    def ceiling_tok_s(self) -> float:
        return self.gemm_gflop_s * 1e9 / self.flop_per_token

    def lines(self) -> list[str]:
        return [f"weights read per token {self.weight_bytes_per_token / 1e6:.0f} MB, "
                f"{self.flop_per_token / 1e9:.2f} GFLOP per token",
                f"copy bandwidth {self.copy_gb_s:.1f} GB/s (read+write) -> batch-1 floor "
                f"{self.floor_tok_s:.1f} tok/s ({1000 / self.floor_tok_s:.1f} ms/token)",
                f"GEMM {self.gemm_gflop_s:.1f} GFLOP/s at 256 rows ({self.gemm32_gflop_s:.1f} at 32) -> "
                f"batched ceiling {self.ceiling_tok_s:.0f} tok/s"]


def model_costs(model: torch.nn.Module) -> tuple[int, float]:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return weight_bytes, 2.0 * sum(m.weight.numel() for m in linears)


def copy_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    src = torch.ones(mb * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def gemm_rate(model: torch.nn.Module, rows: int, repeats: int = 3) -> float:
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    ws = [torch.randn(*s) for s in shapes]
    xs = [torch.randn(rows, w.shape[1]) for w in ws]
    flop = sum(2.0 * rows * w.numel() for w in ws)

    def run() -> None:
        for x, w in zip(xs, ws, strict=True):
            F.linear(x, w)

    run()
    return flop / min(_timed(run) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(model: torch.nn.Module) -> Limits:
    with torch.inference_mode():
        weight_bytes, flop = model_costs(model)
        return Limits(weight_bytes, flop, copy_bandwidth(), gemm_rate(model, 256), gemm_rate(model, 32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    from workbench.models import load_model

    limits = measure(load_model(args.model, device="cpu").model)
    print("\n".join(limits.lines()))


if __name__ == "__main__":
    main()
