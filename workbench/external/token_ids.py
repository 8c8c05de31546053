"""Token ids of what an external server streamed, in the reference tokenizer's vocabulary.

Owns: loading the reference tokenizer from a model spec without loading weights
(`load_reference_tokenizer`), the prompt's ids as the reference would see them (`prompt_ids`:
a chat is rendered with the tokenizer's own template), and `TokenIds`, which turns a token as a
server reports it into an id: `token_id:123` (vLLM's `return_tokens_as_token_ids`) is the
server's own id; otherwise the token's bytes (chat `bytes`, vLLM's `bytes:\\xe2` form, or the text's
UTF-8) are looked up in the vocabulary, marked recovered; bytes that match no token give -1.
Does not own the HTTP side (sse_stream.py).
"""

from __future__ import annotations

import re
from typing import Any

from workbench.external.records import ID_RECOVERED, ID_SERVER, ID_UNKNOWN
from workbench.models.bytelevel import UNICODE_TO_BYTE

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def load_reference_tokenizer(spec: str) -> Any:
    """The tokenizer of a model spec (smollm2, tiny-random, a folder, ...): no weights are loaded."""
    from transformers import AutoTokenizer

    from workbench.models.loader import resolve_folder

    folder, _ = resolve_folder(spec)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.workbench_spec = spec  # what the trace's meta names
    return tok


def prompt_ids(tokenizer: Any, prompt: str | None, messages: list[dict[str, Any]] | None) -> list[int]:
    """The ids the reference model would read: the prompt text, or the chat with its generation prompt."""
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt).input_ids)



def parse_reported_bytes(text: str) -> bytes | None:
    """vLLM writes a token that is not valid UTF-8 on its own as `bytes:\\xe2\\x80`; None otherwise."""
    if not text.startswith("bytes:"):
        return None
    try:
        return text[len("bytes:"):].encode("latin-1").decode("unicode_escape").encode("latin-1")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return None


class TokenIds:
    """Reported token -> (id, how it was obtained), through one bytes -> id table of the vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        self.by_bytes: dict[bytes, int] = {}
        vocab = tokenizer.get_vocab()
        for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
            self.by_bytes.setdefault(self._piece_bytes(piece), tid)  # the lowest id wins a tie
        self.size = max(vocab.values()) + 1 if vocab else 0

    def _piece_bytes(self, piece: str) -> bytes:
        m = _BYTE_TOKEN.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level and piece and all(ch in UNICODE_TO_BYTE for ch in piece):
            return bytes(UNICODE_TO_BYTE[ch] for ch in piece)
        if not self.byte_level:
            return piece.replace("\u2581", " ").encode("utf-8")
        return piece.encode("utf-8")

    def resolve(self, text: str, raw_bytes: list[int] | None = None) -> tuple[int, str]:
        """`(token_id, ID_SERVER | ID_RECOVERED | ID_UNKNOWN)` for a token as a server reported it."""
        m = _TOKEN_ID.match(text)
        if m:
            return int(m.group(1)), ID_SERVER
        data = bytes(raw_bytes) if raw_bytes is not None else parse_reported_bytes(text)
        if data is None:
            data = text.encode("utf-8")
        tid = self.by_bytes.get(data)
        if tid is not None:
            return tid, ID_RECOVERED
        if raw_bytes is None and text:  # a server that decoded the text differently: one token of it?
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1:
                return int(ids[0]), ID_RECOVERED
        return -1, ID_UNKNOWN

    def text_of(self, token_id: int) -> str:
        """The text of an id (for `token_id:N` tokens, whose reported text is only the id)."""
        try:
            return self.tokenizer.decode([token_id])
        except Exception:  # an id outside the reference vocabulary
            return ""
