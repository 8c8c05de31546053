"""Prefix sharing between requests in flight: n > 1 siblings and requests with a common prompt start.

Owns: `PrefixSharing`, which pairs a new request with one not yet prefilled that shares at least
`MIN_SHARED_PREFIX` leading prompt tokens (it waits, then copies that KV instead of computing it),
holds such a request back while its source prefills, and performs the copy (`fork_prefix`) when
the source's prefill completes (`fork_waiting`). Does not own: the prefix cache of finished requests
(prefix_cache.py) or the copy itself (kv.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from workbench.engine.sched.batch import Fork
from workbench.engine.sched.kv import RequestKV
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import PrefixCache, common_prefix_len
from workbench.engine.sched.queues import Queues
from workbench.engine.sched.request import Req


class PrefixSharing:
    MIN_SHARED_PREFIX = 16  # shorter common prefixes are cheaper to recompute than to wait for

    def __init__(self, queues: Queues, memory: Memory, kv: RequestKV, prefix_cache: PrefixCache | None) -> None:
        self.queues = queues
        self.memory = memory
        self.kv = kv
        self.prefix_cache = prefix_cache

    @staticmethod
    def held(req: Req) -> bool:
        """A sibling waits while the request whose prompt KV it will copy has not prefilled yet."""
        src = req.share_prefix_from
        if src is not None and src.finished:
            req.share_prefix_from = None  # the source ended before its prefill completed: prefill alone
        return req.share_prefix_from is not None

    def share_prompt_prefix(self, req: Req) -> None:
        """In-flight prefix sharing: when a request not yet prefilled (waiting, or mid-prefill) shares
        at least MIN_SHARED_PREFIX leading prompt tokens with `req`, `req` waits for that prefill and
        copies the shared KV instead of computing it (like n > 1 siblings). Requests asking for prompt
        logprobs always compute their own prompt."""
        if req.params.prompt_logprobs:
            return
        best, best_len = None, self.MIN_SHARED_PREFIX - 1
        if self.prefix_cache is not None:  # only wait for an in-flight prefill that beats the cache
            best_len = max(best_len, self.prefix_cache.match(req.prompt_ids, len(req.prompt_ids) - 1)[1])
        for src in [*self.queues.running, *self.queues.waiting]:
            if src.output_ids or src.finished or src.params.prompt_logprobs:
                continue  # already past its prefill: the hand-off happens when a prefill completes
            n = common_prefix_len(src.prompt_ids, req.prompt_ids, len(req.prompt_ids) - 1)
            if n > best_len:
                best, best_len = src, n
        if best is not None:
            req.share_prefix_from, req.share_len = best, best_len

    def fork_waiting(self, src: Req) -> Iterator[Fork]:
        """`src` finished its prefill: every waiting request that waited for it copies its KV now, one
        at a time as the caller takes them (so each is reported before the next copy)."""
        for sib in [r for r in self.queues.waiting if r.share_prefix_from is src]:
            whole = sib.share_len is None  # n > 1: the same prompt, its prompt logprobs too
            slots = self.fork_prefix(src, sib)
            if slots is None:
                continue
            if whole:
                sib.prompt_logprobs, sib.prompt_ranks = list(src.prompt_logprobs), list(src.prompt_ranks)
                sib.prompt_top_logprobs = list(src.prompt_top_logprobs)
            yield Fork(sib, slots, src, whole)

    def fork_prefix(self, src: Req, dst: Req) -> torch.Tensor | None:
        """Give waiting `dst` a copy of `src`'s prompt KV except the last prompt token (which `dst`
        recomputes to get its own logits) in fresh slots, and move it to running. Returns the new
        slots, or None (then `dst` prefills by itself) when there is no room or nothing to share."""
        dst.share_prefix_from = None
        n = len(src.prompt_ids) - 1 if dst.share_len is None else min(dst.share_len, len(dst.prompt_ids) - 1)
        pool, alloc = self.memory.req_to_token_pool, self.memory.allocator
        if (dst not in self.queues.waiting or src.req_pool_idx is None or src.kv_len < n or n < 1
                or not pool.can_allocate() or alloc.available_size() - len(self.queues.running) - 1 < n):
            return None
        dst.req_pool_idx = pool.allocate()
        slots = self.kv.copy_prefix(self.kv.slots(src, 0, n), dst)
        dst.cached_prompt_tokens = n
        self.queues.start(dst)
        return slots
