"""A request's KV as the scheduler manages it: copying a prefix in, reading its slots, releasing it.

Owns: `RequestKV`, the one place that gives a request KV it did not compute (a copy of a cached
prefix or of a sibling's prompt) and that frees a request's slots, or hands them to the prefix
cache when a finished request's KV is worth keeping. Does not own: the pools (memory.py), the
cache's entries and eviction (prefix_cache.py) or deciding when to do any of this (scheduler.py).
"""

from __future__ import annotations

import torch

from workbench.engine.sched.batch import Released
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import CacheEntry, PrefixCache
from workbench.engine.sched.request import Req


class RequestKV:
    def __init__(self, memory: Memory, prefix_cache: PrefixCache | None) -> None:
        self.memory = memory
        self.prefix_cache = prefix_cache

    def slots(self, req: Req, start: int = 0, end: int | None = None) -> torch.Tensor:
        """KV slots of `req`'s tokens `start:end` (default: all it has), int64 on the CPU."""
        end = req.kv_len if end is None else end
        return self.memory.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].cpu()

    def copy_prefix(self, src_slots: torch.Tensor, dst: Req) -> torch.Tensor:
        """Give `dst` (holding a request slot, no KV yet) fresh slots with a copy of `src_slots`' KV as
        its first tokens; returns the new slots."""
        n = src_slots.numel()
        slots = self.memory.allocator.allocate(n)
        pool = self.memory.req_to_token_pool
        pool.req_to_token[dst.req_pool_idx, :n] = slots.to(pool.req_to_token.device)
        self.memory.copy_kv(src_slots, slots)
        dst.kv_len = n
        return slots

    def copy_cached(self, entry: CacheEntry, req: Req, n: int) -> torch.Tensor:
        """Copy the first `n` tokens' KV of a cache entry into `req` (just admitted)."""
        slots = self.copy_prefix(entry.slots[:n], req)
        req.cached_prompt_tokens = min(n, len(req.prompt_ids))
        self.prefix_cache.use(entry, n)
        return slots

    def release(self, req: Req, cache: bool = False) -> Released:
        """Free the request slot of `req` and its KV slots, or with `cache` (a finished request) hand
        the KV to the prefix cache."""
        slots, kept, dropped = torch.empty(0, dtype=torch.int64), False, []
        if req.req_pool_idx is not None:
            slots = self.slots(req)
            if cache and self.prefix_cache is not None and req.kv_len >= PrefixCache.MIN_MATCH:
                kept, dropped = self.prefix_cache.insert(req.fill_ids[:req.kv_len], slots, req.req_id)
            else:
                self.memory.allocator.free(slots)
            self.memory.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0
        return Released(slots, kept, dropped)
