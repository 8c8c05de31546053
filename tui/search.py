"""Search over generated text and token ids, reading the trace in step order a chunk at a time.

Owns: the query syntax (`#123` or `id:123` is a token id; anything else is text, matched across
token boundaries, case-insensitive unless the query has a capital letter) and `find` (the next or
previous match from a step, wrapping around). Runs in a worker thread and stops early when the
worker is cancelled. Does not own where the match is shown (the screen selects it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from workbench.trace.events import TokenChosen
from workbench.trace.live import TraceView

_ID_QUERY = re.compile(r"^(?:#|id:)(\d+)$")
_WINDOW = 256  # steps read per query when searching backwards


@dataclass(frozen=True, slots=True)
class Query:
    text: str
    token_id: int | None
    fold: bool  # case-insensitive

    @classmethod
    def parse(cls, query: str) -> Query:
        """`#123`/`id:123`: that token id; otherwise text (smart case). ValueError for an empty query."""
        if not query:
            raise ValueError("search: the query is empty")
        m = _ID_QUERY.match(query.strip())
        if m:
            return cls(query, int(m.group(1)), False)
        return cls(query, None, query == query.lower())


@dataclass(frozen=True, slots=True)
class SearchHit:
    step: int
    req_id: str
    position: int  # the token that completes the match
    positions: tuple[int, ...]  # every token the match spans


class _Matcher:
    """Feeds tokens of many interleaved requests; reports matches that end in the newest token."""

    def __init__(self, query: Query, allowed: frozenset[str] | None) -> None:
        self.query, self.allowed = query, allowed
        self.needle = query.text.lower() if query.fold else query.text
        self.tails: dict[str, list[tuple[int, str]]] = {}

    def feed(self, tok: TokenChosen) -> SearchHit | None:
        rid = tok.req_id
        if rid is None or (self.allowed is not None and rid not in self.allowed):
            return None
        if self.query.token_id is not None:
            return SearchHit(tok.step, rid, tok.position, (tok.position,)) if tok.token_id == self.query.token_id else None
        text = tok.text.lower() if self.query.fold else tok.text
        tail = self.tails.setdefault(rid, [])
        tail.append((tok.position, text))
        joined = "".join(t for _, t in tail)
        start = joined.find(self.needle, max(0, len(joined) - len(text) - len(self.needle) + 1))
        hit = None
        if start >= 0 and start + len(self.needle) > len(joined) - len(text):
            hit = SearchHit(tok.step, rid, tok.position, _spanned(tail, start, start + len(self.needle)))
        while len(tail) > 1 and sum(len(t) for _, t in tail[1:]) >= len(self.needle):
            tail.pop(0)  # keep just enough text to catch a match that ends in the next token
        return hit


def _spanned(tail: list[tuple[int, str]], start: int, end: int) -> tuple[int, ...]:
    out, offset = [], 0
    for pos, text in tail:
        if offset < end and offset + len(text) > start:
            out.append(pos)
        offset += len(text)
    return tuple(out)


def _scan(source: TraceView, query: Query, allowed: frozenset[str] | None, lo: int, hi: int,
          cancelled: Callable[[], bool], first_only: bool) -> SearchHit | None:
    """The first (or last) match in steps lo..hi inclusive."""
    matcher, found = _Matcher(query, allowed), None
    for n, event in enumerate(source.events(kind="token", step_range=(lo, hi))):
        if n % 512 == 0 and cancelled():
            return None
        if isinstance(event, TokenChosen):
            hit = matcher.feed(event)
            if hit is not None:
                if first_only:
                    return hit
                found = hit
    return found


def find(source: TraceView, query: Query, start: int, last: int, forward: bool = True,
         allowed: frozenset[str] | None = None, cancelled: Callable[[], bool] = lambda: False,
         ) -> SearchHit | None:
    """The next match after step `start` (or the previous one before it), wrapping around 0..last."""
    if forward:
        return (_scan(source, query, allowed, start + 1, last, cancelled, True)
                or _scan(source, query, allowed, 0, start, cancelled, True))
    for hi in list(range(start - 1, -1, -_WINDOW)) + list(range(last, start - 1, -_WINDOW)):
        lo = max(hi - _WINDOW + 1, 0 if hi < start else start)
        hit = _scan(source, query, allowed, lo, hi, cancelled, False)
        if hit is not None or cancelled():
            return hit
    return None
