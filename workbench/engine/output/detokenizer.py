"""Incremental detokenization of one request's output ids, with stop strings.

This module owns turning token ids into streamed text: vLLM-style `prefix_offset / read_offset`
windows (each push decodes only `ids[prefix_offset:]`, never the whole output), the held-back tail
while the text ends in an incomplete character, and stop strings (earliest completed match, hold
back of a tail that could still start one, cut unless `include_stop_str_in_output`). It does not
decide finish reasons (`finish.py`), parse tool calls (`tool_parser.py`) or emit trace events
(`DetokUpdate.trace_fields()` gives the `DetokState` payload; the engine emits it).

Contract (tested on a byte-level BPE and a SentencePiece byte-fallback tokenizer):
- the concatenated deltas (plus `flush()`) equal `text`, and a delta is never retracted;
- without a stop match, `text == render(output_ids)`, where `render` is `tokenizer.decode(ids,
  skip_special_tokens=..., clean_up_tokenization_spaces=False)` (see `render_ids`); with
  `prompt_ids` the text is what the output adds to the last prompt ids;
- with a stop match, `text` is that rendering cut at the match (start, or end when included) and
  `output_ids` ends at the token that completed the match.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder renders for bytes of a not-yet-complete character
SEED_PROMPT_TOKENS = 5  # prompt ids kept as decoding context (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


@dataclass(frozen=True, slots=True)
class DetokUpdate:
    """What one `push` did: the ids consumed, the window offsets, held-back text and the emitted delta."""

    new_ids: list[int]  # ids consumed by this push (ids after a stop match are dropped)
    prefix_offset: int  # window start, indexing the decode buffer (seed prompt ids, then output ids)
    read_offset: int  # end of the text already settled in the buffer
    decoded_len: int  # characters decoded so far: emitted + held
    held_text: str  # decoded but not emitted
    held_reason: str | None  # None | "incomplete_char" | "possible_stop" (the first when both are held)
    delta: str  # text newly emitted to the stream by this push
    stop_matched: str | None = None
    stop_token_index: int | None = None  # output ids to keep when a stop string completed
    finished_by_stop: bool = False

    def trace_fields(self) -> dict[str, Any]:
        """The payload of a `workbench.trace.events.DetokState` event."""
        return {"new_ids": list(self.new_ids), "prefix_offset": self.prefix_offset,
                "read_offset": self.read_offset, "decoded_len": self.decoded_len,
                "held_text": self.held_text, "held_reason": self.held_reason, "delta": self.delta,
                "stop_matched": self.stop_matched}


# --- what the detokenizer needs to know about a tokenizer ----------------------------------------


@dataclass(frozen=True, slots=True)
class _TokenizerFacts:
    backend_decode: Callable[..., str] | None  # the Rust decoder when the HF class adds nothing to it
    byte_ids: frozenset[int]  # `<0xNN>` ids of a ByteFallback decoder (empty for byte-level BPE)
    added_ids: frozenset[int]  # ids of added tokens (specials and user-added)
    special_ids: frozenset[int]  # added tokens marked special: what skip_special_tokens drops


_FACTS: weakref.WeakKeyDictionary[Any, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _facts(tokenizer: Any) -> _TokenizerFacts:
    """Facts about `tokenizer`, memoised per tokenizer object (they never change)."""
    try:
        return _FACTS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend_decode = None
    for cls in type(tokenizer).__mro__:  # fast path only when no class overrides decode/_decode
        if cls.__name__ == "TokenizersBackend" and backend is not None:
            backend_decode = backend.decode
            break
        if "decode" in cls.__dict__ or "_decode" in cls.__dict__:
            break
    byte_ids: frozenset[int] = frozenset()
    if backend is not None and "ByteFallback" in str(backend.decoder):
        names = [f"<0x{b:02X}>" for b in range(256)]
        ids = tokenizer.convert_tokens_to_ids(names)
        unk = getattr(tokenizer, "unk_token_id", None)
        byte_ids = frozenset(i for i in ids if i is not None and i != unk)
    added_tokens = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    special = {int(i) for i, t in added_tokens.items() if getattr(t, "special", True)}
    special |= {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    facts = _TokenizerFacts(backend_decode, byte_ids, frozenset(int(i) for i in added_tokens),
                            frozenset(special))
    try:
        _FACTS[tokenizer] = facts
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return facts


def render_ids(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
    """The reference rendering of `ids`: what the detokenizer's text equals when no stop cut it.

    It is `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`,
    except that with `spaces_between_special_tokens=False` (and specials kept) two consecutive
    added tokens are joined with nothing between them (vLLM's meaning for fast tokenizers), even
    where the decoder would put a space. Tokenization clean-up is never applied: it rewrites text
    already streamed (" ." -> ".") and transformers skips it for BPE tokenizers anyway.
    """
    return _renderer(tokenizer, skip_special_tokens, spaces_between_special_tokens)(ids)


def _renderer(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
              ) -> Callable[[Sequence[int]], str]:
    """`render_ids` with its settings bound, built once per detokenizer (it runs for every token)."""
    facts = _facts(tokenizer)
    if facts.backend_decode is not None:
        backend_decode = facts.backend_decode

        def dec(part: Sequence[int]) -> str:
            return backend_decode(list(part), skip_special_tokens=skip_special_tokens)
    else:
        def dec(part: Sequence[int]) -> str:
            return tokenizer.decode(list(part), skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
    if skip_special_tokens or spaces_between_special_tokens or not facts.added_ids:
        return dec
    added = facts.added_ids

    def joined(ids: Sequence[int]) -> str:
        parts, start = [], 0
        for k in range(1, len(ids)):
            if ids[k] in added and ids[k - 1] in added:
                parts.append(dec(ids[start:k]))
                start = k
        parts.append(dec(ids[start:]))
        return "".join(parts)

    return joined


# --- stop strings --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StopMatch:
    stop: str
    start: int
    end: int


class _StopStrings:
    """Earliest-completion matching and the 'could still become a stop string' tail."""

    def __init__(self, stops: Sequence[str]) -> None:
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._firsts = frozenset(s[0] for s in self.stops)

    def earliest(self, text: str) -> _StopMatch | None:
        """The match that completes first in `text` (smallest end); a tie goes to the earliest start."""
        best: _StopMatch | None = None
        for s in self.stops:
            i = text.find(s)
            if i < 0:
                continue
            m = _StopMatch(s, i, i + len(s))
            if best is None or (m.end, m.start) < (best.end, best.start):
                best = m
        return best

    def hold_from(self, text: str) -> int:
        """Index where the held tail of `text` starts: the earliest suffix that is a proper prefix of a stop string."""
        for i in range(max(0, len(text) - self.max_len + 1), len(text)):
            if text[i] in self._firsts:
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    return i
        return len(text)


# --- the detokenizer -----------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streams one request's text from its output ids; usable alone with any HF tokenizer.

    Each `push` decodes only the window `ids[prefix_offset:]` and takes the text past
    `decode(ids[prefix_offset:read_offset])`; the window moves on once that text is settled. Text
    is held back while it is not final (`held_reason="incomplete_char"`): a trailing U+FFFD that
    later bytes may complete or, for byte-fallback tokenizers, a run of `<0xNN>` tokens still open
    (a later invalid byte turns the whole run into U+FFFD, as `decode` does). A settled tail that is
    a proper prefix of a stop string is held too (`"possible_stop"`).

    Stop strings are matched once more than `min_new_tokens` output ids were pushed (the stop
    string must complete on a later token). The match that *completes* earliest in the text wins;
    if several complete at the same character, the one starting earliest (the longest) wins, so the
    result does not depend on how the text was split into tokens. After a stop match, or after
    `flush()`, the detokenizer is finished: `push` raises RuntimeError, `flush` returns "".

    `skip_special_tokens` / `spaces_between_special_tokens` render as `render_ids` does.
    `prompt_ids`: the last few are decoding context only (never emitted), so a first output token
    like "▁Hello" keeps its leading space as in `decode(prompt + output)`; ignored when those prompt
    ids end in an incomplete character.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Sequence[str] | str | None = (),
                 include_stop_str_in_output: bool = False, prompt_ids: Sequence[int] | None = None,
                 min_new_tokens: int = 0) -> None:
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_new_tokens = min_new_tokens
        self._stops = _StopStrings([stop] if isinstance(stop, str) else list(stop or ()))
        facts = _facts(tokenizer)
        self._byte_ids = facts.byte_ids
        # ids the decoder never sees: they neither close nor open a run of byte tokens
        self._invisible = facts.special_ids if skip_special_tokens else frozenset()
        self._render = _renderer(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._byte_run_open = False
        self._ids: list[int] = self._seed(list(prompt_ids or ()))
        self._num_seed = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = self._num_seed
        self._prefix_text = self._render(self._ids)
        self._window_settled = 0  # chars of the window text (past prefix_text) already settled
        self._pending = ""  # settled, not emitted: could start a stop string
        self._unsettled = ""  # decoded, not final yet
        self._parts: list[str] = []
        self._emitted_len = 0
        self._finished = False
        self.stop_matched: str | None = None

    # -- public surface --------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The text emitted so far (the concatenated deltas); the final text once finished."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def output_ids(self) -> list[int]:
        """The output ids pushed so far (ids after a stop match are not kept)."""
        return self._ids[self._num_seed:]

    @property
    def held_text(self) -> str:
        return self._pending + self._unsettled

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, new_ids: Sequence[int]) -> DetokUpdate:
        """Append output ids; return what was emitted, what is held and whether a stop string ended it."""
        if self._finished:
            raise RuntimeError("detokenizer already finished (stop string matched or flushed); "
                               "create a new one per request")
        delta: list[str] = []
        consumed: list[int] = []
        match: _StopMatch | None = None
        for tid in new_ids:
            tid = int(tid)
            consumed.append(tid)
            self._ids.append(tid)
            if tid not in self._invisible:
                self._byte_run_open = tid in self._byte_ids
            self._decode_step()
            if self._stops.stops and len(self._ids) - self._num_seed > self.min_new_tokens:
                match = self._stops.earliest(self._pending + self._unsettled.rstrip(REPLACEMENT_CHAR))
                if match is not None:
                    delta.append(self._finish_at(match))
                    break
            keep = self._stops.hold_from(self._pending) if self._stops.stops else len(self._pending)
            delta.append(self._pending[:keep])
            self._pending = self._pending[keep:]
        out = "".join(delta)
        self._emit(out)
        return self._update(consumed, out, match)

    def flush(self) -> str:
        """End the stream for a reason other than a stop string: release every held character.

        Returns the released text (the final rendering, U+FFFD included, as `decode` shows it).
        """
        if self._finished:
            return ""
        tail = self._pending + self._unsettled
        self._pending = self._unsettled = ""
        self._finished = True
        self._emit(tail)
        return tail

    # -- internals -------------------------------------------------------------------------------

    def _seed(self, prompt_ids: list[int]) -> list[int]:
        seed = prompt_ids[-SEED_PROMPT_TOKENS:]
        visible = [t for t in seed if t not in self._invisible]
        if not visible or visible[-1] in self._byte_ids or self._render(seed).endswith(REPLACEMENT_CHAR):
            return []
        return seed

    def _decode_step(self) -> None:
        """Decode the window after one appended id; move settled text to `_pending`."""
        new_text = self._render(self._ids[self._prefix_offset:])
        window = new_text[len(self._prefix_text):]
        if self._byte_run_open:
            settled = self._window_settled  # an open byte run: nothing new is final
        elif self._byte_ids:
            settled = len(window)  # a closed run is final even when it rendered as U+FFFD
        else:
            settled = len(window.rstrip(REPLACEMENT_CHAR))
        if settled > self._window_settled:
            self._pending += window[self._window_settled:settled]
            self._window_settled = settled
        self._unsettled = window[self._window_settled:]
        if window and not self._unsettled:  # all settled: slide the window (vLLM's offset update)
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._render(self._ids[self._prefix_offset:self._read_offset])
            self._window_settled = 0

    def _finish_at(self, match: _StopMatch) -> str:
        """Cut at `match`, drop later ids, finish; return the text still to emit."""
        region = self._pending + self._unsettled
        cut = match.end if self.include_stop_str_in_output else match.start
        self._pending = self._unsettled = ""
        self._finished = True
        self.stop_matched = match.stop
        return region[:cut]

    def _emit(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._emitted_len += len(text)

    def _update(self, consumed: list[int], delta: str, match: _StopMatch | None) -> DetokUpdate:
        held = self.held_text
        reason = "incomplete_char" if self._unsettled else ("possible_stop" if self._pending else None)
        return DetokUpdate(
            new_ids=consumed, prefix_offset=self._prefix_offset, read_offset=self._read_offset,
            decoded_len=self._emitted_len + len(held), held_text=held, held_reason=reason,
            delta=delta, stop_matched=match.stop if match else None,
            stop_token_index=len(self.output_ids) if match else None,
            finished_by_stop=match is not None)
