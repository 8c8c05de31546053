"""KV memory: the request-to-token table, the token-level slot allocator and the per-layer K/V pool.

SGLang semantics. `ReqToTokenPool` maps a request slot to the row of KV slot indices holding its
tokens; `TokenToKVPoolAllocator` hands out token slots (slot 0 is reserved as padding and never
handed out); `KVPool` holds one K and one V tensor per layer, `[num_slots, kv_heads, head_dim]`.
Allocation is paired: `can_allocate / allocate / free`. Nothing here knows about tracing.
"""

from __future__ import annotations

import torch

from workbench.engine.kernels import native


class ReqToTokenPool:
    """Request slot -> row of KV slot indices (`req_to_token[slot, pos]`)."""

    def __init__(self, size: int, max_context_len: int, device: str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("ReqToTokenPool exhausted: allocate() without can_allocate()")
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.size:
            raise RuntimeError(f"ReqToTokenPool: double free or bad slot {slot}")
        self._free.append(slot)


# the orders free KV slots are handed out in (`Engine(kv_slot_order=...)`): both first-in-first-out
# (a freed slot goes to the back); "restart" (the default) also starts again from slot 1 whenever
# every slot is free, so a server that goes idle between bursts reuses the pool pages it has touched
# instead of walking into fresh ones (0.55 MB of RSS a round under issue 19's 5,000-prompt client,
# growing until the whole pool was touched); "fifo" is the order of traces recorded before it
KV_SLOT_ORDERS = ("restart", "fifo")


class TokenToKVPoolAllocator:
    """Token-level allocator over `size` usable KV slots, numbered 1..size (0 is padding)."""

    def __init__(self, size: int, device: str, order: str = "restart") -> None:
        if order not in KV_SLOT_ORDERS:
            raise ValueError(f"kv_slot_order must be one of {', '.join(KV_SLOT_ORDERS)}, got {order!r}")
        self.size = size
        self.device = device
        self.order = order
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._is_free = torch.ones(size + 1, dtype=torch.bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return int(self._free.numel())

    def used(self) -> int:
        return self.size - int(self._free.numel())

    def can_allocate(self, n: int) -> bool:
        return n <= self._free.numel()

    def allocate(self, n: int) -> torch.Tensor:
        """Return `n` free slot indices (int64, CPU); raises if the caller skipped can_allocate."""
        if n > self._free.numel():
            raise RuntimeError(f"KV pool exhausted: asked for {n}, {self._free.numel()} free")
        out, self._free = self._free[:n], self._free[n:]
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).cpu()
        if bool(self._is_free[slots].any()) or bool((slots == 0).any()):
            raise RuntimeError("KV pool: double free, or freeing the reserved slot 0")
        self._is_free[slots] = True
        if self.order == "restart" and self._free.numel() + slots.numel() == self.size:
            self._free = torch.arange(1, self.size + 1, dtype=torch.int64)  # all free: from slot 1 again
        else:
            self._free = torch.cat([self._free, slots])


class KVPool:
    """Per-layer K and V tensors of `[num_slots + 1, kv_heads, head_dim]` (row 0 is padding).

    Allocated with `torch.empty`, not `torch.zeros`: zeroing a 1 GiB pool touches every page at
    load (a large share of the start-up on CPU), while an untouched page costs nothing until a slot
    on it is written. Nothing reads a slot before it is written: attention reads only slots of
    positions already computed (written by `write` this step or an earlier one, or by `copy_kv`),
    except padding, which reads row 0, zeroed here (masked out, but a NaN there would turn the
    masked softmax's `0 * v` into NaN). tests/engine/test_engine_core.py fills every other row with NaN
    and checks the tokens and logprobs do not change."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        shape = (num_slots + 1, kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
        # what `write` compares before its C copy (the pools are contiguous, made here)
        self._cpu, self._dtype, self._row = torch.device(device).type == "cpu", dtype, torch.Size(shape[1:])
        self._row_bytes = kv_heads * head_dim * self.k[0].element_size() if self.k else 0
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k, v` of shape `[num_tokens, kv_heads, head_dim]` at slots `loc`.

        On CPU, with contiguous sources of the pool's dtype, one C call copies the rows (kernels/c/
        layer_ops.c `wb_kv_write`, the bytes index_copy_ copies): two index_copy_ calls a layer
        took 20-50 us each, 1-2.5 ms of a batch-32 step. Elsewhere, or with a slot outside the
        pool, index_copy_ runs (and says what is wrong)."""
        pk, pv = self.k[layer], self.v[layer]
        lib = native.load() if self._cpu else None
        if lib is not None and k.dtype == self._dtype and v.dtype == self._dtype and loc.dtype == torch.int64 \
                and k.shape == v.shape and k.shape[1:] == self._row and loc.dim() == 1 and loc.shape[0] == k.shape[0] \
                and k.is_cpu and v.is_cpu and loc.is_cpu and k.is_contiguous() and v.is_contiguous() \
                and loc.is_contiguous() \
                and lib.wb_kv_write(pk.data_ptr(), pv.data_ptr(), pk.shape[0], loc.data_ptr(), loc.shape[0],
                                    k.data_ptr(), v.data_ptr(), self._row_bytes) == 0:
            return
        # index_copy_ is ~50x cheaper than `buf[loc] = k` (advanced-index assignment) on CPU.
        pk.index_copy_(0, loc, k)
        pv.index_copy_(0, loc, v)


class Memory:
    """The three memory parts together, sized from a token budget."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, kv_tokens: int, max_running: int,
                 max_context_len: int, dtype: torch.dtype, device: str, slot_order: str = "restart") -> None:
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len, device)
        self.allocator = TokenToKVPoolAllocator(kv_tokens, device, slot_order)
        self.kv = KVPool(num_layers, kv_tokens, kv_heads, head_dim, dtype, device)

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots `src` to slots `dst` (n > 1 siblings sharing a prompt)."""
        src, dst = src.to(self.kv.k[0].device), dst.to(self.kv.k[0].device)
        for k, v in zip(self.kv.k, self.kv.v):
            k[dst] = k[src]
            v[dst] = v[src]
