"""Logprobs in the OpenAI shapes of each endpoint, with each token's real bytes.

Owns: `TokenBytes` (the UTF-8 bytes a token stands for: byte-level BPE symbols mapped back to
bytes, SentencePiece `<0xNN>` byte tokens and the `▁` space), `chat_logprobs` (`{"content":
[{token, logprob, bytes, top_logprobs}]}`) and `completion_logprobs` (`{tokens, token_logprobs,
top_logprobs, text_offset}`). A logprob of minus infinity is sent as -9999.0, as OpenAI does.
Does not own: computing logprobs (the engine's sampler) or choosing which tokens are reported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from workbench.engine.output.output import TokenLogprob
from workbench.models.bytelevel import UNICODE_TO_BYTE
from workbench.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
MIN_LOGPROB = -9999.0



class TokenBytes:
    """Token id -> its bytes, cached; works for byte-level BPE and SentencePiece byte fallback."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute(token_id, text)
            self._cache[token_id] = cached
        return cached

    def _compute(self, token_id: int, text: str) -> list[int]:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        except Exception:
            piece = None
        if isinstance(piece, str):
            m = _BYTE_TOKEN.match(piece)
            if m:
                return [int(m.group(1), 16)]
            if self.byte_level and piece and all(ch in UNICODE_TO_BYTE for ch in piece):
                return [UNICODE_TO_BYTE[ch] for ch in piece]
            if "\u2581" in piece and not self.byte_level:
                return list(piece.replace("\u2581", " ").encode("utf-8"))
        return list(text.encode("utf-8"))


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(items: Sequence[TokenLogprob], token_bytes: TokenBytes) -> ChatLogprobs:
    content = []
    for it in items:
        tops = [TopLogprob(token=text, logprob=_lp(lp), bytes=token_bytes(tid, text)) for tid, text, lp in it.top_logprobs]
        content.append(ChatTokenLogprob(token=it.token, logprob=_lp(it.logprob),
                                        bytes=token_bytes(it.token_id, it.token), top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(items: Sequence[TokenLogprob], top_k: int, text_offset: int) -> CompletionLogprobs:
    """Legacy completions shape; `text_offset` is where the first token's text starts in the choice text."""
    tokens, lps, offsets, tops = [], [], [], []
    offset = text_offset
    for it in items:
        tokens.append(it.token)
        lps.append(_lp(it.logprob))
        offsets.append(offset)
        offset += len(it.token)
        top: dict[str, float] = {}
        for _, text, lp in it.top_logprobs[:top_k]:
            top.setdefault(text, _lp(lp))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops if top_k else None,
                              text_offset=offsets)
