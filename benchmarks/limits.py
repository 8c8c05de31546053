"""How far a throughput figure is from what this machine allows, measured in the same run:

- the memory-bandwidth floor at batch 1: every decode step reads each weight matrix once, so a
  token takes at least (bytes of weights read per token) / (the machine's read bandwidth). The read
  bandwidth is the best of a large tensor copy (bytes read + written, as STREAM counts) and a read
  loop in C with several streams a thread (benchmarks/c/limits.c): one stream a thread, as
  `torch.sum` reads, runs at the hardware prefetcher's pace, not the memory's (about 27 against 55
  GB/s on the 2-core EPYC VMs), and a kernel that reads in several streams beats a floor set by it
  (benchmarks/c/limits.c);
- the compute ceiling batched: (the model's FLOP per token) / (measured float32 GEMM rate), MKL's
  at 256 rows (the rate transformers' own GEMMs reach), and beside it the machine's float32 FMA
  peak (benchmarks/c/limits.c), which no GEMM beats (a decode batch's blocked kernel does beat
  MKL's 256-row rate on the EPYC).

    python benchmarks/limits.py [--model smollm2]

`--isa avx2` (here and in throughput.py and step_profile.py) re-runs the script with every library
capped to AVX2 (`ISA_CAPS`): what an AVX2-only CPU runs, on this CPU's memory, caches and clocks.
"""

from __future__ import annotations

import argparse
import functools
import os
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
    read_gb_s: float  # bytes read per second by the C read loop (0 where no C compiler)
    gemm_gflop_s: float  # float32 GEMM at the model's shapes, 256 rows
    gemm32_gflop_s: float  # the same at 32 rows (a decode batch)
    peak_gflop_s: float = 0.0  # the FMA peak on the widest vectors (0 where no C compiler)

    @property
    def read_bandwidth(self) -> float:
        """Bytes a second the floor takes: the best of the copy and the read loop."""
        return max(self.copy_gb_s, self.read_gb_s) * 1e9

    @property
    def floor_tok_s(self) -> float:
        """Batch 1 can not beat this: the weights streamed from memory once per token."""
        return self.read_bandwidth / self.weight_bytes_per_token

    @property
    def ceiling_tok_s(self) -> float:
        return self.gemm_gflop_s * 1e9 / self.flop_per_token

    @property
    def peak_tok_s(self) -> float:
        return self.peak_gflop_s * 1e9 / self.flop_per_token

    def lines(self) -> list[str]:
        return [f"weights read per token {self.weight_bytes_per_token / 1e6:.0f} MB, "
                f"{self.flop_per_token / 1e9:.2f} GFLOP per token",
                f"read bandwidth {self.read_bandwidth / 1e9:.1f} GB/s (copy {self.copy_gb_s:.1f} read+write, read loop "
                f"{self.read_gb_s:.1f}) -> batch-1 floor {self.floor_tok_s:.1f} tok/s "
                f"({1000 / self.floor_tok_s:.1f} ms/token)",
                f"GEMM {self.gemm_gflop_s:.1f} GFLOP/s at 256 rows ({self.gemm32_gflop_s:.1f} at 32) -> "
                f"batched ceiling {self.ceiling_tok_s:.0f} tok/s; FMA peak {self.peak_gflop_s:.1f} GFLOP/s -> "
                f"{self.peak_tok_s:.0f} tok/s"]


# The code an AVX2-only CPU runs, chosen on an AVX512 one: ATen's AVX2 build, MKL and oneDNN capped
# to AVX2 (which peers load too: vLLM's and transformers' GEMMs), and the C kernels and limits.c
# built without AVX512 (workbench/engine/kernels/native.py). The verdicts of this engine's kernels
# are kept apart for it (kernels/environment.py ISA_VARIABLES) and checked afresh.
ISA_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "WORKBENCH_NATIVE_FLAGS": "-mno-avx512f"}}


def add_isa_argument(ap: argparse.ArgumentParser) -> None:
    """`--isa`, the same in every script that measures speed; `run_capped(args.isa)` acts on it."""
    ap.add_argument("--isa", choices=sorted(ISA_CAPS), default=None,
                    help="re-run with torch, MKL, oneDNN and the C kernels capped to this instruction set "
                    "(what an AVX2-only CPU runs; peers inherit it)")


def run_capped(isa: str | None) -> None:
    """Re-execute this script with `ISA_CAPS[isa]` set (peers started from it inherit them), unless
    they already are; nothing for None."""
    if isa is None:
        return
    caps = ISA_CAPS[isa]
    if any(os.environ.get(k) != v for k, v in caps.items()):
        print(f"re-running capped to {isa}: " + " ".join(f"{k}={v}" for k, v in caps.items()), flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **caps})


def isa_label() -> str:
    """', capped to AVX2 (...)' where `ISA_CAPS` (or any variable that narrows the instruction set)
    is set, else ''."""
    from workbench.engine.kernels.environment import isa_settings

    caps = isa_settings()
    return f", capped to {torch.backends.cpu.get_cpu_capability()} ({caps})" if caps else ""


def best(a: Limits, b: Limits) -> Limits:
    """The higher of each rate measured twice: the VM's bandwidth and GEMM rate drift with its
    neighbours by up to a third within minutes, and a floor must hold for the whole run."""
    return Limits(a.weight_bytes_per_token, a.flop_per_token, max(a.copy_gb_s, b.copy_gb_s),
                  max(a.read_gb_s, b.read_gb_s), max(a.gemm_gflop_s, b.gemm_gflop_s),
                  max(a.gemm32_gflop_s, b.gemm32_gflop_s), max(a.peak_gflop_s, b.peak_gflop_s))


def model_costs(model: torch.nn.Module) -> tuple[int, float]:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return weight_bytes, 2.0 * sum(m.weight.numel() for m in linears)


def _buffers(mb: int) -> list[torch.Tensor]:
    """Float buffers of `mb` MB of ones: one from torch's allocator (4 KB pages here) and, where the
    system has them, one in 2 MB huge pages, as the engine's weights are held (models/loader.py
    `to_huge_pages`): a floor must be the faster of the two."""
    from workbench.models.loader import huge_page_bytes, huge_pages_available

    out = [torch.ones(mb * (1 << 20) // 4)]
    if huge_pages_available():
        out.append(huge_page_bytes(mb << 20).view(torch.float32).fill_(1.0))
    return out


def copy_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    best = float("inf")
    for src, dst in zip(_buffers(mb), _buffers(mb), strict=True):  # both in the same kind of pages
        dst.copy_(src)
        best = min(best, *(_timed(lambda dst=dst, src=src: dst.copy_(src)) for _ in range(repeats)))
    return 2 * mb * (1 << 20) / best / 1e9


def read_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Bytes read a second (GB/s) by benchmarks/c/limits.c, best over 4 and 8 streams a
    thread with and without software prefetch, in 4 KB and (where there are) 2 MB pages; 0.0
    where it can not be built."""
    lib = _read_lib()
    if lib is None:
        return 0.0
    threads = torch.get_num_threads()
    fastest = float("inf")
    for src in _buffers(mb):
        for streams in (4, 8):
            for ahead in (0, 256):
                def run(src: torch.Tensor = src, streams: int = streams, ahead: int = ahead) -> None:
                    lib.wb_read_streams(src.data_ptr(), src.numel(), streams, ahead, threads)

                run()
                fastest = min(fastest, *(_timed(run) for _ in range(repeats)))
    return mb * (1 << 20) / fastest / 1e9


def fma_peak(iters: int = 20_000_000, repeats: int = 3) -> float:
    """GFLOP/s of benchmarks/c/limits.c's FMA loop on every thread; 0.0 where it can not be built."""
    import ctypes

    lib = _read_lib()
    if lib is None:
        return 0.0
    threads, sink = torch.get_num_threads(), ctypes.c_float()
    lanes = lib.wb_fma_peak(1000, threads, ctypes.byref(sink))
    fastest = min(_timed(lambda: lib.wb_fma_peak(iters, threads, ctypes.byref(sink))) for _ in range(repeats))
    return 2.0 * lanes * 12 * iters * threads / fastest / 1e9


@functools.cache
def _read_lib():
    import ctypes
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    out = Path(tempfile.mkdtemp()) / "read_bandwidth.so"
    src = Path(__file__).parent / "c" / "limits.c"
    from workbench.engine.kernels.native import FLAGS_VARIABLE

    extra = os.environ.get(FLAGS_VARIABLE, "").split()  # as the engine's kernels are built (ISA_CAPS)
    proc = subprocess.run([compiler, "-O3", "-march=native", *extra, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(out)],
                          capture_output=True, timeout=120)
    if proc.returncode != 0:
        return None
    lib = ctypes.CDLL(str(out))
    lib.wb_read_streams.restype = ctypes.c_float
    lib.wb_read_streams.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.wb_fma_peak.restype = ctypes.c_int
    lib.wb_fma_peak.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    return lib


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
        return Limits(weight_bytes, flop, copy_bandwidth(), read_bandwidth(), gemm_rate(model, 256), gemm_rate(model, 32),
                      fma_peak())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    add_isa_argument(ap)
    args = ap.parse_args()
    run_capped(args.isa)
    from workbench.models import load_model

    limits = measure(load_model(args.model, device="cpu", huge_pages=True).model)
    print("\n".join(limits.lines()))


if __name__ == "__main__":
    main()
