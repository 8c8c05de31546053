"""Scheduler: continuous batching under a token budget, with chunked prefill, MIXED batches,
preemption by recompute and abort.

Owns: the waiting queue and the running set, which requests run each step and how many of their
tokens (`ScheduleBatch`), KV admission and preemption, and releasing a request's KV. Does not own:
building tensors (forward_batch.py) or finish rules (finish.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from workbench.engine.run.forward_batch import ForwardMode, RowSpec
from workbench.engine.sample.logprobs import prompt_logprob_rows
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import CacheEntry, PrefixCache, common_prefix_len
from workbench.engine.sched.request import Req, ReqStatus


@dataclass(slots=True)
class PrefillChunk:
    req: Req
    start: int
    length: int
    last_chunk: bool


@dataclass(slots=True)
class ScheduleBatch:
    """What runs this step: prefill chunks first, then decodes (row order of the ForwardBatch)."""

    mode: ForwardMode
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Req] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)
    token_budget: int = 0
    # prefix cache: requests that copied cached KV at admission (req, its new slots, source request),
    # and entries evicted to make room for this step
    cache_hits: list[tuple[Req, torch.Tensor, str]] = field(default_factory=list)
    evicted: list[CacheEntry] = field(default_factory=list)

    @property
    def reqs(self) -> list[Req]:
        return [c.req for c in self.prefill] + self.decode

    @property
    def tokens_scheduled(self) -> int:
        return sum(c.length for c in self.prefill) + len(self.decode)

    def rows(self) -> list[RowSpec]:
        # A scoring request (max_new_tokens=0) samples nothing; prompt logprobs need every prompt row.
        rows = [RowSpec(c.req.req_id, c.req.req_pool_idx, c.start, c.req.fill_ids[c.start:c.start + c.length],
                        1 if c.last_chunk and c.req.params.max_new_tokens > 0 else 0,
                        prompt_logprob_rows(c.req, c.start, c.length)) for c in self.prefill]
        rows += [RowSpec(r.req_id, r.req_pool_idx, r.kv_len, [r.fill_ids[-1]], 1) for r in self.decode]
        return rows


class Released(NamedTuple):
    """What releasing a request did with its KV."""

    slots: torch.Tensor  # its KV slots: freed, or kept by the prefix cache
    kept: bool  # the prefix cache kept them
    dropped: list[CacheEntry]  # cache entries the new one superseded (their slots freed)


class Scheduler:
    def __init__(self, memory: Memory, *, max_batch_tokens: int, chunk_size: int, max_context_len: int,
                 enable_mixed: bool = True) -> None:
        if max_batch_tokens < 1 or chunk_size < 1:
            raise ValueError("max_batch_tokens and chunk_size must be >= 1")
        self.memory = memory
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.max_context_len = max_context_len
        self.enable_mixed = enable_mixed
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._order = itertools.count()
        self.prefix_cache: PrefixCache | None = None  # set by the engine when prefix_cache=True
        self.spec_headroom = 0  # KV slots each running request may take for drafts in one step
        self.preempted_slots: dict[str, torch.Tensor] = {}  # this step's preemptions: the slots they freed

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
        req.status = ReqStatus.WAITING
        req.queue_order = next(self._order)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch:
        alloc = self.memory.allocator
        self.preempted_slots = {}
        evicted = self._make_room()
        decode = [r for r in self.running if r.output_ids and r.seq_len - r.kv_len == 1]
        preempted = []
        while decode and not alloc.can_allocate(len(decode)):
            victim = self._preempt_latest(preempted)
            decode = [r for r in decode if r is not victim]
        budget = self.max_batch_tokens
        decode = decode[:budget]
        batch = ScheduleBatch(ForwardMode.IDLE, decode=decode, preempted=preempted, token_budget=budget,
                              evicted=evicted)
        budget -= len(decode)
        if decode and not self.enable_mixed:
            budget = 0
        self._schedule_prefill(batch, budget)
        # Partly prefilled requests can hold the whole pool between them with nothing decoding:
        # no request could ever move again. Recompute the latest arrival until one can.
        while not batch.prefill and not batch.decode and len(self.running) > 1:
            self._preempt_latest(batch.preempted)
            self._schedule_prefill(batch, budget)
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

    def _cached_prefix(self, req: Req) -> tuple[CacheEntry | None, int]:
        """The prefix cache's longest entry for a request about to be admitted (never its last token:
        that one is computed for its logits)."""
        if self.prefix_cache is None or req.params.prompt_logprobs or req.kv_len:
            return None, 0
        return self.prefix_cache.match(req.fill_ids, req.seq_len - 1)

    def _schedule_prefill(self, batch: ScheduleBatch, budget: int) -> None:
        alloc, pool = self.memory.allocator, self.memory.req_to_token_pool
        decoding = {id(r) for r in batch.decode}
        candidates = [r for r in self.running if id(r) not in decoding and r.seq_len - r.kv_len >= 1
                      and not (r.output_ids and r.seq_len - r.kv_len == 1)]
        # Slots this step's decodes take, plus one per running request for the next step's decode.
        reserve = len(batch.decode) + len(self.running)
        queue = candidates + list(self.waiting)
        for req in queue:
            if budget <= 0:
                break
            if self._held_for_prefix(req):
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
                self.waiting.remove(req)
                self.running.append(req)
                req.status = ReqStatus.RUNNING
                reserve += 1
                if entry is not None:
                    batch.cache_hits.append((req, self._copy_cached(entry, req, cached), entry.source))
            batch.prefill.append(PrefillChunk(req, req.kv_len, chunk, req.kv_len + chunk == req.seq_len))
            budget -= chunk
            reserve += chunk

    def _copy_cached(self, entry: CacheEntry, req: Req, n: int) -> torch.Tensor:
        """Copy the first `n` tokens' KV of a cache entry into `req` (just admitted)."""
        slots = self._copy_prefix(entry.slots[:n], req)
        req.cached_prompt_tokens = min(n, len(req.prompt_ids))
        self.prefix_cache.use(entry, n)
        return slots

    def _copy_prefix(self, src_slots: torch.Tensor, dst: Req) -> torch.Tensor:
        """Give `dst` (holding a request slot, no KV yet) fresh slots with a copy of `src_slots`' KV as
        its first tokens; returns the new slots."""
        n = src_slots.numel()
        slots = self.memory.allocator.allocate(n)
        pool = self.memory.req_to_token_pool
        pool.req_to_token[dst.req_pool_idx, :n] = slots.to(pool.req_to_token.device)
        self.memory.copy_kv(src_slots, slots)
        dst.kv_len = n
        return slots

    # --- n > 1: siblings share the prompt's prefill -------------------------------------------

    @staticmethod
    def _held_for_prefix(req: Req) -> bool:
        """A sibling waits while the request whose prompt KV it will copy has not prefilled yet."""
        src = req.share_prefix_from
        if src is not None and src.finished:
            req.share_prefix_from = None  # the source ended before its prefill completed: prefill alone
        return req.share_prefix_from is not None

    MIN_SHARED_PREFIX = 16  # shorter common prefixes are cheaper to recompute than to wait for

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
        for src in [*self.running, *self.waiting]:
            if src.output_ids or src.finished or src.params.prompt_logprobs:
                continue  # already past its prefill: the hand-off happens when a prefill completes
            n = common_prefix_len(src.prompt_ids, req.prompt_ids, len(req.prompt_ids) - 1)
            if n > best_len:
                best, best_len = src, n
        if best is not None:
            req.share_prefix_from, req.share_len = best, best_len

    def fork_prefix(self, src: Req, dst: Req) -> torch.Tensor | None:
        """Give waiting `dst` a copy of `src`'s prompt KV except the last prompt token (which `dst`
        recomputes to get its own logits) in fresh slots, and move it to running. Returns the new
        slots, or None (then `dst` prefills by itself) when there is no room or nothing to share."""
        dst.share_prefix_from = None
        n = len(src.prompt_ids) - 1 if dst.share_len is None else min(dst.share_len, len(dst.prompt_ids) - 1)
        pool, alloc = self.memory.req_to_token_pool, self.memory.allocator
        if (dst not in self.waiting or src.req_pool_idx is None or src.kv_len < n or n < 1
                or not pool.can_allocate() or alloc.available_size() - len(self.running) - 1 < n):
            return None
        dst.req_pool_idx = pool.allocate()
        slots = self._copy_prefix(self.kv_slots(src, 0, n), dst)
        dst.cached_prompt_tokens = n
        self.waiting.remove(dst)
        self.running.append(dst)
        dst.status = ReqStatus.RUNNING
        return slots

    # --- release ---------------------------------------------------------------------------

    def kv_slots(self, req: Req, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = req.kv_len if end is None else end
        return self.memory.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].cpu()

    def release(self, req: Req, cache: bool = False) -> Released:
        """Free the request slot of `req` and its KV slots, or with `cache` (a finished request) hand
        the KV to the prefix cache."""
        slots, kept, dropped = torch.empty(0, dtype=torch.int64), False, []
        if req.req_pool_idx is not None:
            slots = self.kv_slots(req)
            if cache and self.prefix_cache is not None and req.kv_len >= PrefixCache.MIN_MATCH:
                kept, dropped = self.prefix_cache.insert(req.fill_ids[:req.kv_len], slots, req.req_id)
            else:
                self.memory.allocator.free(slots)
            self.memory.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0
        if req in self.running:
            self.running.remove(req)
        return Released(slots, kept, dropped)

    def _preempt_latest(self, preempted: list[Req]) -> Req:
        """Preempt the running request admitted last (recomputed later); record it in `preempted`."""
        victim = max(self.running, key=lambda r: r.queue_order)
        self._preempt(victim)
        preempted.append(victim)
        return victim

    def _preempt(self, req: Req) -> None:
        self.preempted_slots[req.req_id] = self.release(req).slots
        req.num_preemptions += 1
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)

    def remove(self, req: Req, cache: bool = False) -> Released:
        """Take `req` out of the scheduler wherever it is (finish or abort); see `release`."""
        if req in self.waiting:
            self.waiting.remove(req)
        return self.release(req, cache)
