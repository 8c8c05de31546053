"""The paged decode-attention kernel (c/decode_attention.c) and its two checks.

Owns: `decode_attention` (attending decode rows over the KV pool in place, read through
`req_to_token`, where the torch path gathers a dense copy per layer first), and the checks of
registry.py's `attention.decode_one_row` (at one row the torch path computes exactly what
transformers computes, so the kernel must be bit-identical to it) and `attention.decode_batch`
(at several rows the torch path's own bits depend on the batch's padding; the kernel's error
against a float64 reference must be within `ERROR_FACTOR` times sdpa's own; the switch's `exact`
value demands identity); and `flash_row` (one decode row over consecutive KV slots exactly as
sdpa's CPU flash kernel computes it, MKL's own sgemm inside, registry.py's
`attention.flash_one_row`). Does not own: the torch path (run/attention.py) or the build (native.py).
"""

from __future__ import annotations

import ctypes
import time

import torch
import torch.nn.functional as F

from workbench.engine.kernels import native, switch
from workbench.engine.kernels.book import BOOK
from workbench.engine.kernels.verdict import Verdict

ERROR_FACTOR = 4.0
ONE_ROW, BATCH = "attention.decode_one_row", "attention.decode_batch"


def check_attention(heads: int, kv_heads: int, head_dim: int) -> None:
    """Decide the kernel for one and for several rows of this head layout now (load time) instead of
    at the first decode step (both verdicts read one run of the probes)."""
    if native.load() is not None:
        for name in (ONE_ROW, BATCH):
            BOOK.decide(name, (heads, kv_heads, head_dim), lambda n=name: _check(heads, kv_heads, head_dim,
                                                                                 _unchecked, n))


_refused: dict[tuple[int, int, int, int], Verdict] = {}  # (one row?, heads, kv_heads, head_dim) -> the refusal


def refused(rows: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Is the kernel refused for this many decode rows (one, or several) and head layout, by the
    verdict the book holds now? Lets the caller skip the argument checks and the query copy before
    each layer's call where the answer is known to be no (batch 1 on the EPYCs: ~5 us a layer)."""
    verdict = _refused.get((rows == 1, heads, kv_heads, head_dim))
    return verdict is not None and \
        BOOK.tables.get(ONE_ROW if rows == 1 else BATCH, {}).get((heads, kv_heads, head_dim)) is verdict


def batch_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Does `decode_attention` run the kernel for several decode rows of this head layout (built, and
    its check passed here)?"""
    return native.load() is not None and BOOK.decide(
        BATCH, (heads, kv_heads, head_dim), lambda: _check(heads, kv_heads, head_dim, _unchecked, BATCH)).ok


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
                     lens: torch.Tensor, out: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> bool:
    """Attend `q [B, H, D]` over each row's first `lens[b]` KV slots `kv_idx[b]` of the pool
    (`[slots, KVH, D]`), writing `out [B, H, D]`; with a sliding `window`, over only the last
    `min(lens[b], window)` of them (the query is at position lens[b]-1); scores soft-capped by
    `softcap`; `sinks [H]` adding one logit per head to the softmax (transformers' `s_aux`). False
    (nothing written) where the kernel does not apply: not built, not CPU float32, a layout it does
    not read, or not found fit for this head layout and row count by its check."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_pool.dtype != torch.float32:
        return False
    lib = native.load()
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
    name = ONE_ROW if b == 1 else BATCH
    verdict = BOOK.decide(name, (h, kvh, d), lambda: _check(h, kvh, d, _unchecked, name))
    if not verdict.ok:
        _refused[(b == 1, h, kvh, d)] = verdict
        return False  # not fit for this layout on this CPU: the torch path
    _unchecked(q, k_pool, v_pool, kv_idx, lens, out, scale, window, softcap, sinks)
    return True


def _unchecked(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_idx: torch.Tensor,
               lens: torch.Tensor, out: torch.Tensor, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    lib = native.load()
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


def _torch_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor,
                  lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention.py's torch path computes for decode rows: gather, masked sdpa. [B, H, D]"""
    b, length = idx.shape
    shape = (b, length, *k_pool.shape[1:])
    k = k_pool.index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
    v = v_pool.index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]


def measure(heads: int, kv_heads: int, head_dim: int, kernel) -> dict[str, float]:
    """The kernel (`kernel(q, k_pool, v_pool, idx, lens, out, scale)`) against the torch path on
    seeded probes: one row at a few lengths (`single_row_max_diff`), then a padded batch of mixed
    lengths as the engine builds them (`kernel_error` and `torch_error` against float64; `kernel_error`
    infinite under the switch's `exact` where the kernel is not bit-identical to the torch path)."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + head_dim)
    scale = head_dim ** -0.5
    single_diff, kernel_err, torch_err = 0.0, 0.0, 0.0
    cases = [torch.tensor([n]) for n in (1, 7, 130)] + [torch.tensor([1, 40, 17, 200, 3, 99, 64, 128])]
    with torch.inference_mode():
        for lens in cases:
            b, length = len(lens), int(lens.max())
            k_pool = torch.randn(b * length + 1, kv_heads, head_dim, generator=gen)
            v_pool = torch.randn(b * length + 1, kv_heads, head_dim, generator=gen)
            idx = (torch.randperm(b * length, generator=gen) + 1).view(b, length)
            idx = idx * (torch.arange(length)[None, :] < lens[:, None])  # padded positions read slot 0
            q = torch.randn(b, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
            out = torch.empty_like(q)
            kernel(q, k_pool, v_pool, idx, lens, out, scale)
            ref = _torch_decode(q, k_pool, v_pool, idx, lens, scale)
            if b == 1:
                single_diff = max(single_diff, float((out - ref).abs().max()))
                continue
            exact = _torch_decode(q.double(), k_pool.double(), v_pool.double(), idx, lens, scale)
            kernel_err = max(kernel_err, float((out.double() - exact).abs().max()))
            torch_err = max(torch_err, float((ref.double() - exact).abs().max()))
            if switch.exact() and not torch.equal(out, ref):
                kernel_err = max(kernel_err, float("inf"))
    return {"single_row_max_diff": single_diff, "kernel_error": kernel_err, "torch_error": torch_err,
            "seconds": round(time.perf_counter() - start, 3)}


_last: list = [None, None]  # the last measurement and what it was of: both checks read one run of the probes


def _check(heads: int, kv_heads: int, head_dim: int, kernel, name: str) -> Verdict:
    of = (heads, kv_heads, head_dim, kernel, switch.exact())
    if _last[0] != of:
        _last[:] = [of, measure(heads, kv_heads, head_dim, kernel)]
    m = _last[1]
    m = {k: v if v != float("inf") else "inf" for k, v in m.items()}  # facts are JSON (the trace's meta)
    if name == ONE_ROW:
        if m["single_row_max_diff"] == 0.0:
            return Verdict(True, "kernel: bit-identical to the torch path at one row", m)
        return Verdict(False, f"torch: the kernel differs from it by up to {m['single_row_max_diff']:.3g} at one "
                       "row, where the torch path is exactly transformers' attention", m)
    if m["kernel_error"] != "inf" and m["kernel_error"] <= ERROR_FACTOR * m["torch_error"]:
        return Verdict(True, f"kernel: within {ERROR_FACTOR:g}x sdpa's own error (kernel {m['kernel_error']:.3g}, "
                       f"sdpa {m['torch_error']:.3g} vs float64)", m)
    if switch.exact():
        return Verdict(False, "torch: the switch says exact and the kernel is not bit-identical", m)
    return Verdict(False, f"torch: kernel error {float(m['kernel_error']):.3g} exceeds {ERROR_FACTOR:g}x sdpa's "
                   f"{m['torch_error']:.3g}", m)


# --- one decode row as torch's flash-attention kernel computes it (c/flash_row.c) ------------------

FLASH_ROW = "attention.flash_one_row"
FLASH_LANES = (16, 8)  # the vector width torch's flash kernel was built for: AVX512, AVX2
FLASH_PROBE_KEYS = (1, 2, 7, 8, 15, 16, 17, 31, 33, 100, 257, 511, 512, 513, 1100)
_sgemm_set = False


def _sgemm_ready(lib) -> bool:
    """Hand the kernel MKL's sgemm_ from the copy torch links (once); False where it has none."""
    global _sgemm_set
    if not _sgemm_set:
        mkl = native.mkl()
        fn = getattr(mkl, "sgemm_", None) if mkl is not None else None
        if fn is None:
            return False
        lib.wb_set_sgemm(ctypes.cast(fn, ctypes.c_void_p))
        _sgemm_set = True
    return True


def flash_row(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor, scale: float) -> bool:
    """One decode row's attention over consecutive KV rows, exactly as sdpa computes it (torch's CPU
    flash-attention kernel): `q [H, D]` (any head stride, rows contiguous), `k_rows, v_rows [L, KVH, D]`
    (a contiguous run of the pool), `out [H, D]` contiguous. False (nothing written) where it does
    not apply or its check (`attention.flash_one_row`) did not find it bit-identical for this head
    layout and thread count on this CPU."""
    lib = native.load()
    if lib is None or q.dtype != torch.float32 or k_rows.dtype != torch.float32 or q.device.type != "cpu":
        return False
    heads, d = q.shape
    keys, kv_heads = k_rows.shape[0], k_rows.shape[1]
    if not (q.stride(1) == 1 and k_rows.is_contiguous() and v_rows.is_contiguous() and out.is_contiguous()
            and v_rows.shape == k_rows.shape and k_rows.shape[2] == d and out.shape == q.shape and keys >= 1):
        return False
    threads = torch.get_num_threads()
    lanes = flash_lanes(heads, kv_heads, d, threads)
    return lanes is not None and _flash_unchecked(q, k_rows, v_rows, out, scale, lanes, threads) == 0


def flash_lanes(heads: int, kv_heads: int, d: int, threads: int) -> int | None:
    """The vector width `attention.flash_one_row` was found bit-identical at for this head layout
    and thread count (checked now if not yet), or None where it was refused."""
    verdict = BOOK.decide(FLASH_ROW, (heads, kv_heads, d, threads), lambda: _check_flash(heads, kv_heads, d, threads))
    return int(verdict.facts["lanes"]) if verdict.ok else None


def _flash_unchecked(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, out: torch.Tensor, scale: float,
                     lanes: int, threads: int) -> int:
    lib = native.load()
    if not _sgemm_ready(lib):
        return -2
    heads, d = q.shape
    rc = lib.wb_flash_row(q.data_ptr(), q.stride(0), k_rows.data_ptr(), v_rows.data_ptr(),
                          k_rows.shape[1] * d, k_rows.shape[0], heads, k_rows.shape[1], d, scale, lanes,
                          out.data_ptr(), threads)
    if rc == -3:
        raise MemoryError("flash row kernel: out of memory for its scratch buffer")
    return rc


def _check_flash(heads: int, kv_heads: int, head_dim: int, threads: int) -> Verdict:
    """Against sdpa itself on seeded probes laid out as the engine lays them out (the query a head
    view of a rotated row, the keys a run of pool slots): lengths on both sides of each vector and of
    the kernel's 512-key blocks, peaked and flat rows; each vector width in turn, the first that
    matches every probe kept (lanes in facts)."""
    lib = native.load()
    if lib is None or not _sgemm_ready(lib):
        return Verdict(False, "torch: no MKL sgemm to call (the kernel reproduces MKL's GEMMs by calling them)", {})
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + head_dim)
    scale = head_dim ** -0.5
    probes = []
    with torch.inference_mode():
        for keys in FLASH_PROBE_KEYS:
            pool_k = torch.randn(keys + 5, kv_heads, head_dim, generator=gen) * 2
            pool_v = torch.randn(keys + 5, kv_heads, head_dim, generator=gen)
            row = torch.randn(1, 1, heads * head_dim, generator=gen) * (4 if keys % 2 else 1)
            q = row.view(1, 1, heads, head_dim).transpose(1, 2)  # [1, H, 1, D], as rotary.apply returns it
            start = 3
            k = pool_k[start:start + keys].view(1, keys, kv_heads, head_dim).transpose(1, 2)
            v = pool_v[start:start + keys].view(1, keys, kv_heads, head_dim).transpose(1, 2)
            want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0, :, 0]
            probes.append((q[0, :, 0], pool_k[start:start + keys], pool_v[start:start + keys], want))
        for lanes in FLASH_LANES:
            same = 0
            for q, k, v, want in probes:
                out = torch.empty(heads, head_dim)
                if _flash_unchecked(q, k, v, out, scale, lanes, threads) == 0 and torch.equal(out, want):
                    same += 1
            if same == len(probes):
                return Verdict(True, f"kernel: bit-identical to sdpa on {len(probes)} probe rows (1-1100 keys), "
                               f"torch's flash kernel at {lanes} lanes", {"lanes": lanes, "probes": len(probes)})
    return Verdict(False, f"torch: no listed vector width ({', '.join(map(str, FLASH_LANES))}) gives sdpa's bits "
                   f"on all {len(probes)} probe rows on this CPU", {"probes": len(probes)})
