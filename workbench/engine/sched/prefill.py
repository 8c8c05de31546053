"""Admission and chunked prefill: which prompts (or recomputations) run this step, how many tokens.

Owns: `PrefillPlanner`, which walks the partly prefilled running requests, then the waiting queue
(first come, first served), admits new requests while request slots and KV allow (keeping one slot
per running request for its next decode), copies a cached prefix into an admitted request when the
prefix cache has one, and cuts each prompt into chunks under the step's token budget. Does not own:
decode selection and preemption (decode.py) or the KV copies themselves (kv.py).
"""

from __future__ import annotations

from workbench.engine.sched.batch import CacheHit, PrefillChunk, ScheduleBatch
from workbench.engine.sched.kv import RequestKV
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import CacheEntry, PrefixCache
from workbench.engine.sched.queues import Queues
from workbench.engine.sched.request import Req
from workbench.engine.sched.sharing import PrefixSharing


class PrefillPlanner:
    def __init__(self, queues: Queues, memory: Memory, kv: RequestKV, prefix_cache: PrefixCache | None,
                 chunk_size: int) -> None:
        self.queues = queues
        self.memory = memory
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.chunk_size = chunk_size

    def _cached_prefix(self, req: Req) -> tuple[CacheEntry | None, int]:
        """The prefix cache's longest entry for a request about to be admitted (never its last token:
        that one is computed for its logits)."""
        if self.prefix_cache is None or req.params.prompt_logprobs or req.kv_len:
            return None, 0
        return self.prefix_cache.match(req.fill_ids, req.seq_len - 1)

    def schedule(self, batch: ScheduleBatch, budget: int) -> None:
        """Add prefill chunks to `batch` within `budget` tokens."""
        alloc, pool = self.memory.allocator, self.memory.req_to_token_pool
        decoding = {id(r) for r in batch.decode}
        running = self.queues.running
        candidates = [r for r in running if id(r) not in decoding and r.seq_len - r.kv_len >= 1
                      and not (r.output_ids and r.seq_len - r.kv_len == 1)]
        # Slots this step's decodes take, plus one per running request for the next step's decode.
        reserve = len(batch.decode) + len(running)
        queue = candidates + list(self.queues.waiting)
        for req in queue:
            if budget <= 0:
                break
            if PrefixSharing.held(req):
                continue
            is_new = req.req_pool_idx is None
            if is_new and not pool.can_allocate():
                break
            free = alloc.available_size() - reserve - (1 if is_new else 0)
            entry, cached = self._cached_prefix(req) if is_new else (None, 0)
            if free - cached < 1:
                entry, cached = None, 0  # no room for the copy and a chunk: prefill all of it
            chunk = min(req.seq_len - req.kv_len - cached, self.chunk_size, budget, free - cached)
            if chunk <= 0 or (is_new and req.num_preemptions and free < req.seq_len):
                # A preempted request comes back only when all of it fits again, or it would be
                # preempted again mid-recompute; the queue stays first come, first served.
                break
            if is_new:
                req.req_pool_idx = pool.allocate()
                self.queues.start(req)
                reserve += 1
                if entry is not None:
                    batch.cache_hits.append(CacheHit(req, self.kv.copy_cached(entry, req, cached), entry.source))
            batch.prefill.append(PrefillChunk(req, req.kv_len, chunk, req.kv_len + chunk == req.seq_len))
            budget -= chunk
            reserve += chunk
