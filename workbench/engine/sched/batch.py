"""What the scheduler hands on: the step's `ScheduleBatch` and the records of its KV changes.

Owns: `PrefillChunk`, `ScheduleBatch` (prefill chunks, then decodes: the row order of the
ForwardBatch), `CacheHit` (a prefix-cache copy made at admission), `Preempted` (a request recomputed
later, with the slots it freed) and `Fork` (a waiting request given a copy of a prefilled prompt's KV) and `Released` (what releasing a
request did with its KV). Records
only: deciding them is the scheduler's (scheduler.py, prefill.py, decode.py, kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.engine.run.forward_batch import ForwardMode, RowSpec
from workbench.engine.sample.logprobs import prompt_logprob_rows
from workbench.engine.sched.prefix_cache import CacheEntry
from workbench.engine.sched.request import Req


@dataclass(slots=True)
class PrefillChunk:
    req: Req
    start: int
    length: int
    last_chunk: bool


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A request admitted with a copy of a cached prefix's KV."""

    req: Req
    slots: torch.Tensor  # its new slots holding the copy
    source: str  # the request that computed the cached KV


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running request preempted this step (recomputed later) and the KV slots that freed."""

    req: Req
    slots: torch.Tensor


@dataclass(frozen=True, slots=True)
class Fork:
    """A waiting request given a copy of a just-prefilled request's prompt KV (n > 1 siblings, or a
    shared prompt start) instead of computing it."""

    req: Req
    slots: torch.Tensor  # its new slots holding the copy
    source: Req
    whole_prompt: bool  # an n > 1 sibling: the same prompt (its prompt logprobs copied too)


@dataclass(frozen=True, slots=True)
class Released:
    """What releasing a request did with its KV."""

    slots: torch.Tensor  # its KV slots: freed, or kept by the prefix cache
    kept: bool  # the prefix cache kept them
    dropped: list[CacheEntry]  # cache entries the new one superseded (their slots freed)


@dataclass(slots=True)
class ScheduleBatch:
    """What runs this step: prefill chunks first, then decodes (row order of the ForwardBatch)."""

    mode: ForwardMode
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Req] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)
    token_budget: int = 0
    preempted_kv: list[Preempted] = field(default_factory=list)  # the slots each preemption freed
    cache_hits: list[CacheHit] = field(default_factory=list)  # prefix-cache copies made at admission
    evicted: list[CacheEntry] = field(default_factory=list)  # cache entries evicted to make room

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
