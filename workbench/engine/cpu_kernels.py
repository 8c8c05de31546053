"""Native CPU kernels, built on first use with the system C compiler and called through ctypes.

Owns: building `kernels/*.c` into a shared library cached under `~/.cache/workbench/kernels`
(keyed by the source, the flags and the machine, built to a temporary name and renamed, so
concurrent processes never load a half-written file), loading it, and the Python wrappers with
their shape checks. Without a compiler, or with `WORKBENCH_CPU_KERNELS=0`, `decode_attention()`
returns False and the caller uses its torch path; nothing here is required.

The one kernel today is paged decode attention (kernels/decode_attention.c): the torch path has to
gather every decode row's K/V out of the pool into a dense copy per layer before
`scaled_dot_product_attention`, which at batch 32 and a few hundred cached tokens costs as much as the
attention itself; the kernel reads the pool in place through `req_to_token`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
ENV_SWITCH = "WORKBENCH_CPU_KERNELS"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "kernels"


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, platform.machine(), platform.node()]).encode())
    target = cache_dir() / f"decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, building it the first time; None where it cannot be built or is switched off."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            warnings.warn(f"workbench: CPU decode-attention kernel unavailable, using torch ({exc})", stacklevel=2)
            return None
        fn = lib.wb_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int64] * 4 + [ctypes.c_float]
        _lib = lib
        return lib


def available() -> bool:
    return load() is not None


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
                     lens: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """Attend `q [B, H, D]` over each row's first `lens[b]` KV slots `kv_idx[b]` of the pool
    (`[slots, KVH, D]`), writing `out [B, H, D]`. False (nothing written) where the kernel does not
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
    if h % kvh or out.shape != q.shape or k_pool.shape[2] != d or kv_idx.shape[0] != b or lens.shape[0] != b:
        return False
    rc = lib.wb_decode_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), kv_idx.data_ptr(),
                                 kv_idx.stride(0), lens.data_ptr(), out.data_ptr(), b, h, kvh, d, scale)
    if rc != 0:
        raise MemoryError("decode attention kernel: out of memory for its score buffers")
    return True
