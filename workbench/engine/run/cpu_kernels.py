"""Native CPU kernels, built on first use with the system C compiler and called through ctypes.

Owns: building `kernels/*.c` into a shared library cached under `~/.cache/workbench/kernels`
(keyed by the source, the flags and the machine, built to a temporary name and renamed, so
concurrent processes never load a half-written file), loading it, and the Python wrappers with
their shape checks. Without a compiler, or with `WORKBENCH_CPU_KERNELS=0`, `decode_attention()`
returns False and the caller uses its torch path; nothing here is required.

Two kernels:
- Paged decode attention (kernels/decode_attention.c): the torch path has to gather every decode
  row's K/V out of the pool into a dense copy per layer before `scaled_dot_product_attention`,
  which at batch 32 and a few hundred cached tokens costs as much as the attention itself; the
  kernel reads the pool in place through `req_to_token`.
- Packed-weight GEMMs for `nn.Linear` (`pack_linears`): MKL's `cblas_sgemm_pack` lays each weight
  out once (when first needed, see PackedLinear) for its GEMM kernel, and `cblas_sgemm_compute` then skips the packing that
  `F.linear` redoes on every call; at 16 to 64 rows (a decode batch) that packing is a large share
  of the GEMM. The MKL inside torch's CPU wheels exports both; where it does not, nothing changes.
  Decode batches (1 to `SPLIT_MAX_ROWS` rows) with two or more threads first split the weight's
  output rows into one slice per thread and run the slices' GEMMs in parallel
  (`PackedLinear.split_compute`, `torch.bmm`), where the check finds that identical to `F.linear`:
  below 16 rows MKL runs `F.linear` on one thread, and up to 64 rows one slice per thread beats
  its own threading, packed or not (on the AMD EPYC it was measured on; on an Intel Xeon it is
  slower, which is why what runs is also raced, fastpath.py). Rows below `PACKED_MIN_ROWS` do not pack (a GEMV-like path,
  where packing buys nothing). Rows above `PACKED_MAX_ROWS` (a prefill chunk: the per-call packing is then a
  small share of the GEMM, and each new row count would cost a check).

Neither kernel is trusted blindly: fastpath.py checks each against the op it replaces on this CPU,
on the shapes and row counts that actually run, and a shape that fails takes the torch op.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from workbench.engine.run.fastpath import (
    CHECKS,
    LINEAR,
    PACKED,
    PACKED_MAX_ROWS,
    PACKED_MIN_ROWS,
    SPLIT,
    SPLIT_MAX_ROWS,
    FastPathChecks,
)

SOURCES = [Path(__file__).parent / "kernels" / name for name in ("decode_attention.c", "sample_draw.c")]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
ENV_SWITCH = "WORKBENCH_CPU_KERNELS"

_lock = threading.Lock()


class _Once:
    """A library loaded at most once per process (thread-safe); None where it is unavailable or
    `WORKBENCH_CPU_KERNELS=0`."""

    def __init__(self, loader: Callable[[], ctypes.CDLL | None]) -> None:
        self.loader, self.tried, self.value = loader, False, None

    def get(self) -> ctypes.CDLL | None:
        with _lock:
            if not self.tried:
                self.tried = True
                self.value = None if os.environ.get(ENV_SWITCH, "1") == "0" else self.loader()
            return self.value


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "kernels"


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, platform.machine(), platform.node()]).encode())
    target = cache_dir() / f"decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load_attention() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"workbench: CPU decode-attention kernel unavailable, using torch ({exc})", stacklevel=3)
        return None
    fn = lib.wb_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                ctypes.c_void_p]
    draw = lib.wb_sample_draw
    draw.restype = None
    draw.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int]
    count = lib.wb_count_above
    count.restype = None
    count.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int]
    return lib


_attention = _Once(_load_attention)


def load() -> ctypes.CDLL | None:
    """The kernel library, building it the first time; None where it cannot be built or is switched off."""
    return _attention.get()


_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
def _load_mkl() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [ctypes.c_int] * 4
    pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    compute.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                             ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


_mkl = _Once(_load_mkl)


def mkl() -> ctypes.CDLL | None:
    """torch's own MKL, for its packed sgemm API; None where torch was built without it."""
    return _mkl.get()


class PackedLinear:
    """The forward of one `nn.Linear` through its MKL-packed weight (CPU float32, `PACKED_MIN_ROWS` to
    `PACKED_MAX_ROWS` rows, and only at row counts where `checks` found it bit-identical to `F.linear`).

    The weight is packed when first needed, not at load: on the layer's second call in that row
    range (the first one, and every call before, computes `F.linear`, which the check found
    bit-identical), or when the check itself needs it. Packing all of SmolLM2 writes about 2 GB
    (MKL's packed layout is padded), which is most of a second even on an idle machine; a one-line
    `workbench generate` (decode at 1 row) or a single prefill never pays it, and a server pays it
    at its second batched step, once."""

    def __init__(self, lib: ctypes.CDLL, module: torch.nn.Linear, checks: FastPathChecks = CHECKS) -> None:
        weight = module.weight.detach()
        self.out_features, self.in_features = weight.shape
        # a weak reference: the module holds this object as its forward, and a cycle would keep the
        # model (and the packed copy) alive after its Engine is dropped, until the cyclic GC runs
        self.lib, self._module, self.checks = lib, weakref.ref(module), checks
        self.nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.out_features, self.in_features)
        self.packed: torch.Tensor | None = None  # packed by `_pack` when first needed
        self.calls_in_range = 0
        self._split: tuple[int, int, torch.Tensor] | None = None  # (parts, weight pointer, weight view)
        self._routes: dict[tuple[int, int], str | None] = {}  # (rows, threads) -> route(rows)

    def _pack(self) -> torch.Tensor:
        with _lock:
            if self.packed is None:
                packed = torch.empty(self.nbytes, dtype=torch.uint8)
                weight = self._module().weight.detach()
                self.lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.out_features, self.in_features,
                                          1.0, weight.data_ptr(), self.in_features, packed.data_ptr())
                self.packed = packed
            return self.packed

    @property
    def module(self) -> torch.nn.Linear:
        return self._module()

    def compute(self, x2: torch.Tensor) -> torch.Tensor:
        """`x2 [rows, in] -> [rows, out]` through the packed weight, unchecked (fastpath.py checks it)."""
        rows = x2.shape[0]
        x2 = x2.contiguous()
        packed = self.packed if self.packed is not None else self._pack()
        bias = self._module().bias
        # with a bias, C starts as the bias and the GEMM adds into it (beta = 1), as F.linear's addmm does
        y = torch.empty((rows, self.out_features), dtype=torch.float32) if bias is None else \
            bias.detach().expand(rows, self.out_features).contiguous()
        self.lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, self.out_features, self.in_features,
                                     x2.data_ptr(), self.in_features, packed.data_ptr(), self.in_features,
                                     0.0 if bias is None else 1.0, y.data_ptr(), self.out_features)
        return y

    def can_split(self) -> bool:
        """Can the split GEMM run with this process's thread count (a slice per thread)?"""
        parts = torch.get_num_threads()
        return parts > 1 and self.out_features % parts == 0

    def split_compute(self, x2: torch.Tensor) -> torch.Tensor:
        """`x2 [rows, in] -> [rows, out]` as one GEMM per thread, each over a slice of the weight's
        output rows (`torch.bmm` runs the slices in parallel), unchecked (fastpath.py checks it).
        The weight is not copied: the slices are a view of it."""
        parts, module = torch.get_num_threads(), self._module()
        weight, rows, n = module.weight.detach(), x2.shape[0], self.out_features
        if self._split is None or self._split[:2] != (parts, weight.data_ptr()):  # a new thread count or weight
            self._split = (parts, weight.data_ptr(), weight.view(parts, n // parts, self.in_features).transpose(1, 2))
        x3 = x2.contiguous().unsqueeze(0).expand(parts, rows, self.in_features)
        bias = module.bias
        y = torch.bmm(x3, self._split[2]) if bias is None else \
            torch.baddbmm(bias.detach().view(parts, 1, n // parts), x3, self._split[2])
        return y.transpose(0, 1).reshape(rows, n)  # [parts, rows, n/parts] -> [rows, n]

    def route(self, rows: int) -> str | None:
        """Which kernel computes `rows` rows: SPLIT, PACKED or None (`F.linear`). The candidates
        are the split GEMM up to SPLIT_MAX_ROWS and the packed one in its range, each only where
        its check found it identical to `F.linear` on this CPU; of those and `F.linear`, the
        fastest on this CPU runs (fastpath's race). Decided on first ask, then kept."""
        key = (rows, torch.get_num_threads())
        kind = self._routes.get(key, ())
        if kind == ():
            kinds = []
            if 1 <= rows <= SPLIT_MAX_ROWS and self.can_split() and self.checks.linear_ok(self, rows, SPLIT):
                kinds.append(SPLIT)
            if PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS and self.checks.linear_ok(self, rows):
                kinds.append(PACKED)
            won = self.checks.fastest(self, rows, tuple(kinds))
            kind = self._routes[key] = None if won == LINEAR else won
            if self.packed is not None and PACKED not in self._routes.values():
                self.packed = None  # packed only for its check or the race: no row count runs it
        return kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self._module()
        rows = x.numel() // self.in_features if x.shape[-1] == self.in_features else 0
        kind = None if (not rows or x.dtype != torch.float32 or x.device.type != "cpu"
                        or torch.is_grad_enabled()) else self.route(rows)
        if kind is None:
            return torch.nn.functional.linear(x, module.weight, module.bias)  # what nn.Linear.forward does
        if kind == SPLIT:
            return self.split_compute(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.packed is None:
            self.calls_in_range += 1
            if self.calls_in_range < 2:  # bit-identical (checked), and packing may never pay off
                return torch.nn.functional.linear(x, module.weight, module.bias)
        return self.compute(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module, budget_bytes: int | None = None, checks: FastPathChecks = CHECKS) -> int:
    """Route every CPU float32 `nn.Linear` of `model` through a packed weight (once per model).
    Returns the bytes the packed copies take once all are packed (each is packed when first needed,
    PackedLinear), 0 when nothing was routed: no MKL, another device or dtype, or more than
    `budget_bytes` (default: a quarter of the memory available now). The layers answer through
    `checks`, which decides the common decode batch sizes now (from its verdict file where it has
    one, else by packing one layer of each shape and checking it)."""
    if getattr(model, "_workbench_packed_bytes", None) is not None:
        return model._workbench_packed_bytes
    lib = mkl()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if lib is None or not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32
                                         for m in linears):
        return 0
    need = sum(lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, *m.weight.shape) for m in linears)
    if budget_bytes is None:
        budget_bytes = _available_memory() // 4
    if need > budget_bytes:
        return 0
    for m in linears:
        m.forward = PackedLinear(lib, m, checks)
    checks.verify_model([m.forward for m in linears])  # the common decode sizes now
    model._workbench_packed_bytes = need
    return need


@contextlib.contextmanager
def disabled(model: torch.nn.Module | None = None) -> Iterator[None]:
    """The torch paths for a while (comparisons, benchmarks): decode attention by gather + sdpa and,
    for `model`, `F.linear` instead of the packed weights."""
    with _lock:
        saved = _attention.value, _attention.tried
        _attention.value, _attention.tried = None, True
    packers = [m.forward for m in (model.modules() if model is not None else ())
               if isinstance(m, torch.nn.Linear) and isinstance(m.forward, PackedLinear)]
    for p in packers:
        del p.module.forward  # back to nn.Linear.forward
    # fast mode's wrappers (fastmode.FastLinear) call a packed forward of their own when the mode is off
    wrapped = [m.forward for m in (model.modules() if model is not None else ())
               if isinstance(m, torch.nn.Linear) and isinstance(getattr(m.forward, "inner", None), PackedLinear)]
    for w in wrapped:
        w.inner, w.saved_inner = None, w.inner
    packed_bytes = getattr(model, "_workbench_packed_bytes", None)
    if packed_bytes is not None:
        model._workbench_packed_bytes = 0  # an Engine built meanwhile reports (and packs) nothing
    try:
        yield
    finally:
        for p in packers:
            p.module.forward = p
        for w in wrapped:
            w.inner = w.saved_inner
        if packed_bytes is not None:
            model._workbench_packed_bytes = packed_bytes
        with _lock:
            _attention.value, _attention.tried = saved


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available() -> bool:
    return load() is not None


def check_attention(heads: int, kv_heads: int, head_dim: int) -> None:
    """Verify the decode-attention kernel for this head layout now (load time) instead of at the
    first decode step; the verdict lands in `fastpath.CHECKS`."""
    if load() is not None:
        CHECKS.attention_ok(2, heads, kv_heads, head_dim, _unchecked_attention)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
                     lens: torch.Tensor, out: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> bool:
    """Attend `q [B, H, D]` over each row's first `lens[b]` KV slots `kv_idx[b]` of the pool
    (`[slots, KVH, D]`), writing `out [B, H, D]`; with a sliding `window`, over only the last
    `min(lens[b], window)` of them (the query is at position lens[b]-1); scores soft-capped by
    `softcap`; `sinks [H]` adding one logit per head to the softmax (transformers' `s_aux`). False (nothing written) where the kernel does not
    apply: not built, not CPU float32, or a layout it does not read."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype != torch.float32:
        return False
    lib = load()
    if lib is None:
        return False
    if not (q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous()
            and kv_idx.dtype == torch.int64 and lens.dtype == torch.int64 and kv_idx.stride(1) == 1
            and lens.is_contiguous()):
        return False
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if sinks.shape != (h,) or sinks.device.type != "cpu":
            return False
    if (h % kvh or out.shape != q.shape or k_pool.shape[2] != d or v_pool.shape != k_pool.shape
            or kv_idx.shape[0] != b or lens.shape[0] != b):
        return False
    if not CHECKS.attention_ok(b, h, kvh, d, _unchecked_attention):
        return False  # not verified for this layout on this CPU (fastpath.py): the torch path
    _unchecked_attention(q, k_pool, v_pool, kv_idx, lens, out, scale, window, softcap, sinks)
    return True


def _unchecked_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
                         lens: torch.Tensor, out: torch.Tensor, scale: float, window: int | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    lib = load()
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    rc = lib.wb_decode_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), kv_idx.data_ptr(),
                                 kv_idx.stride(0), lens.data_ptr(), out.data_ptr(), b, h, kvh, d, scale,
                                 torch.get_num_threads(), k_pool.shape[0], int(window or 0), float(softcap or 0.0),
                                 sinks.data_ptr() if sinks is not None else None)
    if rc == -2:
        raise IndexError("decode attention: a KV slot index or a row length is outside the pool / slot table")
    if rc != 0:
        raise MemoryError("decode attention kernel: out of memory for its score buffers")

