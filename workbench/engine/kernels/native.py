"""The native libraries: the C kernels built on first use with the system compiler, and torch's MKL.

Owns: building `c/*.c` into one shared library under the cache root's `kernels/` (keyed by the
source, the flags and the machine; built to a temporary name and renamed, so concurrent processes
never load a half-written file), loading it and torch's own MKL (for its packed sgemm) at most once
per process, and `native_off()`, the torch paths for a while. Without a compiler or MKL, or with the
switch's `torch` value, `load()` / `mkl()` return None and every caller takes its torch path.
Does not own: the kernels' wrappers or checks (gemm.py, decode_attention.py, sampling.py).
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
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from workbench.engine.kernels import switch
from workbench.engine.kernels.store import cache_root

SOURCES = [Path(__file__).parent / "c" / name for name in ("decode_attention.c", "sample_draw.c", "linear_rowdot.c", "linear_rows.c", "topk.c",
                                                                     "layer_ops.c", "flash_row.c", "decode_layers.c")]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# extra compiler flags, after FLAGS: `-mno-avx512f` builds the kernels' AVX2 paths on an AVX512 CPU,
# as an AVX2-only CPU builds them (docs/kernels.md); part of the library's and the verdicts' keys
FLAGS_VARIABLE = "WORKBENCH_NATIVE_FLAGS"


def flags() -> list[str]:
    return [*FLAGS, *os.environ.get(FLAGS_VARIABLE, "").split()]


def compiler() -> str | None:
    """The C compiler the kernels are built with: `CC`, else `cc`, else `gcc` (None where none is)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

lock = threading.Lock()


class Once:
    """A library loaded at most once per process (thread-safe); None where it is unavailable or the
    switch says `torch`."""

    def __init__(self, loader: Callable[[], ctypes.CDLL | None]) -> None:
        self.loader, self.tried, self.value = loader, False, None

    def get(self) -> ctypes.CDLL | None:
        with lock:
            if not self.tried:
                self.tried = True
                self.value = self.loader() if switch.native() else None
            return self.value


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join([compiler, *flags(), platform.machine(), platform.node()]).encode())
    target = cache_dir() / f"decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags(), *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load_c() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
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
    argmax = lib.wb_argmax
    argmax.restype = None
    argmax.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
    count = lib.wb_count_above
    count.restype = None
    count.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int]
    topk = lib.wb_topk
    topk.restype = ctypes.c_int
    topk.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    log_softmax = lib.wb_log_softmax
    log_softmax.restype = ctypes.c_int
    log_softmax.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                                      ctypes.c_int64, ctypes.c_int] + \
        [ctypes.c_void_p] * 5 + [ctypes.c_int]
    blocked = lib.wb_linear_rows
    blocked.restype = ctypes.c_int
    blocked.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    split = lib.wb_linear_rows_split
    split.restype = ctypes.c_int
    split.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                                     ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    rowdot_rows = lib.wb_linear_rowdot_rows
    rowdot_rows.restype = ctypes.c_int
    rowdot_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    rowdot = lib.wb_linear_rowdot
    rowdot.restype = ctypes.c_int
    rowdot.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    group = lib.wb_linear_rowdot_group
    group.restype = ctypes.c_int
    group.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]
    norm = lib.wb_rms_norm
    norm.restype = ctypes.c_int
    norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    flash = lib.wb_flash_row
    flash.restype = ctypes.c_int
    flash.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + \
        [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.wb_set_sgemm.restype = None
    lib.wb_set_sgemm.argtypes = [ctypes.c_void_p]
    entropy = lib.wb_entropy
    entropy.restype = ctypes.c_int
    entropy.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
    silu_mul = lib.wb_silu_mul
    silu_mul.restype = ctypes.c_int
    silu_mul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    rope = lib.wb_rope
    rope.restype = ctypes.c_int
    rope.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    kv_write = lib.wb_kv_write
    kv_write.restype = ctypes.c_int
    kv_write.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    layers = lib.wb_decode_layers
    layers.restype = ctypes.c_int
    layers.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    layers_rows = lib.wb_decode_layers_rows
    layers_rows.restype = ctypes.c_int
    layers_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6 + \
        [ctypes.c_int64, ctypes.c_void_p]
    return lib


c_library = Once(_load_c)


def load() -> ctypes.CDLL | None:
    """The C kernel library, building it the first time; None where it cannot be built or is switched off."""
    return c_library.get()


def available() -> bool:
    return load() is not None


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


_mkl = Once(_load_mkl)


def mkl() -> ctypes.CDLL | None:
    """torch's own MKL, for its packed sgemm API; None where torch was built without it."""
    return _mkl.get()


@contextlib.contextmanager
def c_kernels_off() -> Iterator[None]:
    """The C kernels unloaded for a while (every caller takes its torch path), then back."""
    with lock:
        saved = c_library.value, c_library.tried
        c_library.value, c_library.tried = None, True
    try:
        yield
    finally:
        with lock:
            c_library.value, c_library.tried = saved
