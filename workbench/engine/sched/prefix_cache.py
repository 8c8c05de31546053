"""Prefix cache: finished requests' KV kept for later requests (opt-in, `Engine(prefix_cache=True)`).

SGLang keeps every finished request's KV in a radix tree and lets new requests share those slots.
This cache keeps the same KV but copies it on a hit instead of sharing slots, so every request
still owns all of its slots and the free / abort / preempt paths and their trace events stay as they
are. A copy costs one indexed copy per layer and no forward pass.

- When a request finishes (stop or length), the KV it computed (prompt and output, all but the last
  token) stays in the pool as an entry instead of being freed. An entry that is a prefix of the new
  one is dropped; a new one that an entry already covers is freed.
- When the scheduler admits a request whose tokens start with at least `MIN_MATCH` tokens of an
  entry, it copies that KV into the request's own slots and prefills only the rest.
- Entries hold only memory that nothing else needs. Before each schedule, the scheduler evicts the
  least recently used entries until this step's work fits (`make_room`), and `clear()` empties the
  cache.

Nothing here traces: the scheduler reports hits and evictions in its `ScheduleBatch`, and the
engine records them as KV events (`alloc` for a hit's copy, `cache` for kept slots, `evict`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from workbench.engine.sched.memory import TokenToKVPoolAllocator


@dataclass(slots=True)
class CacheEntry:
    tokens: list[int]
    slots: torch.Tensor  # int64, CPU: the KV slot of each token
    source: str  # the request that computed it
    hits: int = 0


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    n = 0
    for x, y in zip(a if limit is None else a[:limit], b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    MIN_MATCH = 16  # shorter prefixes are cheaper to recompute than to look up and copy
    MAX_ENTRIES = 256  # bounds the linear lookup; the least recently used entry goes first

    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()  # least recently used first
        self._keys = itertools.count()
        self.tokens = 0  # KV slots the cache holds
        self.hits = self.hit_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def insert(self, tokens: list[int], slots: torch.Tensor, source: str) -> tuple[bool, list[CacheEntry]]:
        """Take ownership of `slots`, the KV of `tokens`. Returns whether a new entry keeps them (False:
        an entry already covers `tokens`, and `slots` are freed) and the entries this drops (their slots
        are freed)."""
        if len(tokens) != slots.numel():
            raise ValueError(f"prefix cache: {len(tokens)} tokens but {slots.numel()} slots")
        dropped = []
        for key, entry in list(self.entries.items()):
            n = common_prefix_len(entry.tokens, tokens)
            if n == len(tokens):  # already cached (an entry starts with all of it): keep the older copy
                self.entries.move_to_end(key)
                self.allocator.free(slots)
                return False, dropped
            if n == len(entry.tokens):  # the new entry covers this one
                dropped.append(self._drop(key))
        self.entries[next(self._keys)] = CacheEntry(list(tokens), slots, source)
        self.tokens += len(tokens)
        while len(self.entries) > self.MAX_ENTRIES:
            dropped.append(self._drop(next(iter(self.entries))))
        return True, dropped

    def match(self, tokens: list[int], limit: int) -> tuple[CacheEntry | None, int]:
        """The entry sharing the longest prefix (at most `limit` tokens, at least MIN_MATCH) with `tokens`."""
        best_key, best = None, self.MIN_MATCH - 1
        for key, entry in self.entries.items():
            n = common_prefix_len(entry.tokens, tokens, limit)
            if n > best or (n == best and best_key is not None):  # ties: the most recently used
                best_key, best = key, n
        if best_key is None:
            return None, 0
        self.entries.move_to_end(best_key)
        return self.entries[best_key], best

    def use(self, entry: CacheEntry, n: int) -> None:
        """Count a hit: `n` tokens of `entry` were copied."""
        entry.hits += 1
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + n

    def make_room(self, need_free: int) -> list[CacheEntry]:
        """Evict least recently used entries until the allocator has `need_free` free slots (or the
        cache is empty). Returns the evicted entries; their slots are free."""
        evicted = []
        while self.entries and self.allocator.available_size() < need_free:
            evicted.append(self._drop(next(iter(self.entries))))
        self.evictions += len(evicted)
        return evicted

    def clear(self) -> list[CacheEntry]:
        evicted = [self._drop(key) for key in list(self.entries)]
        self.evictions += len(evicted)
        return evicted

    def _drop(self, key: int) -> CacheEntry:
        entry = self.entries.pop(key)
        self.allocator.free(entry.slots)
        self.tokens -= len(entry.tokens)
        return entry

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.entries), "tokens": self.tokens, "hits": self.hits,
                "hit_tokens": self.hit_tokens, "evictions": self.evictions}
