"""Scheduler: continuous batching under a token budget, with chunked prefill, MIXED batches,
preemption by recompute and abort.

Owns: the step's decision (`schedule()` -> `ScheduleBatch`): evict cached prefixes until the step's
work fits, pick the decodes (decode.py), fill the rest of the token budget with prefill chunks
(prefill.py), and break a deadlock of partly prefilled requests by preemption; refusing requests
that can never fit; taking a finished or aborted request out (`remove`). Its parts: `Queues`
(queues.py), `RequestKV` (kv.py), `PrefixSharing` (sharing.py). Does not own: building tensors
(forward_batch.py) or finish rules (finish.py). The prefix cache and the speculative headroom come
in through the constructor.
"""

from __future__ import annotations

from collections.abc import Iterator

from workbench.engine.run.forward_batch import ForwardMode
from workbench.engine.sched.batch import Fork, Released, ScheduleBatch
from workbench.engine.sched.decode import DecodePlanner
from workbench.engine.sched.kv import RequestKV
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefill import PrefillPlanner
from workbench.engine.sched.prefix_cache import CacheEntry, PrefixCache
from workbench.engine.sched.queues import Queues
from workbench.engine.sched.request import Req
from workbench.engine.sched.sharing import PrefixSharing


class Scheduler:
    def __init__(self, memory: Memory, *, max_batch_tokens: int, chunk_size: int, max_context_len: int,
                 enable_mixed: bool = True, prefix_cache: PrefixCache | None = None, spec_headroom: int = 0) -> None:
        if max_batch_tokens < 1 or chunk_size < 1:
            raise ValueError("max_batch_tokens and chunk_size must be >= 1")
        self.memory = memory
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.max_context_len = max_context_len
        self.enable_mixed = enable_mixed
        self.prefix_cache = prefix_cache
        self.spec_headroom = spec_headroom  # KV slots each running request may take for drafts in one step
        self.queues = Queues()
        self.kv = RequestKV(memory, prefix_cache)
        self.sharing = PrefixSharing(self.queues, memory, self.kv, prefix_cache)
        self.decode = DecodePlanner(self.queues, memory, self.kv)
        self.prefill = PrefillPlanner(self.queues, memory, self.kv, prefix_cache, chunk_size)

    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    # --- admission -------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a request that could never run to completion, naming the limit it breaks."""
        kv_total = self.memory.allocator.size
        if prompt_len == 0:
            raise ValueError("prompt must not be empty")
        if prompt_len >= self.max_context_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the model's context length is "
                             f"{self.max_context_len} (prompt must be shorter)")
        if prompt_len + max_new_tokens > kv_total:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the KV "
                             f"pool of {kv_total} tokens; lower max_new_tokens or raise kv_tokens")

    def add(self, req: Req) -> None:
        self.queues.add(req)

    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.running)

    def share_prompt_prefix(self, req: Req) -> None:
        self.sharing.share_prompt_prefix(req)

    def fork_waiting(self, src: Req) -> Iterator[Fork]:
        """`src` completed its prefill: the requests waiting to copy its prompt KV get it now."""
        return self.sharing.fork_waiting(src)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch:
        budget = self.max_batch_tokens
        batch = ScheduleBatch(ForwardMode.IDLE, token_budget=budget, evicted=self._make_room())
        self.decode.schedule(batch, budget)
        budget -= len(batch.decode)
        if batch.decode and not self.enable_mixed:
            budget = 0
        self.prefill.schedule(batch, budget)
        # Partly prefilled requests can hold the whole pool between them with nothing decoding:
        # no request could ever move again. Recompute the latest arrival until one can.
        while not batch.prefill and not batch.decode and len(self.running) > 1:
            self.decode.preempt_latest(batch)
            self.prefill.schedule(batch, budget)
        has_prefill, has_decode = bool(batch.prefill), bool(batch.decode)
        batch.mode = (ForwardMode.MIXED if has_prefill and has_decode else ForwardMode.EXTEND if has_prefill
                      else ForwardMode.DECODE if has_decode else ForwardMode.IDLE)
        return batch

    def _make_room(self) -> list[CacheEntry]:
        """Evict cached prefixes until this step's work fits: every running request's decode now and
        next step (with its drafts), the prefill still pending up to one step's token budget, and a
        preempted request's whole sequence (it comes back only when all of it fits)."""
        cache = self.prefix_cache
        if cache is None or not cache.entries:
            return []
        pending = sum(r.seq_len - r.kv_len for r in self.running if r.seq_len - r.kv_len > 1)
        pending += sum(r.seq_len + 1 for r in self.waiting)
        need = len(self.running) * (2 + self.spec_headroom) + min(pending, self.max_batch_tokens)
        if self.waiting and self.waiting[0].num_preemptions:
            need += self.waiting[0].seq_len
        return cache.make_room(min(need, self.memory.allocator.size))

    # --- release ---------------------------------------------------------------------------

    def remove(self, req: Req, cache: bool = False) -> Released:
        """Take `req` out of the scheduler wherever it is (finish or abort) and release its KV: freed,
        or with `cache` (a finished request) handed to the prefix cache."""
        self.queues.drop(req)
        return self.kv.release(req, cache)
