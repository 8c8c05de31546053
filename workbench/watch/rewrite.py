"""What `watch` adds to a sampled request, and taking it off the response again, byte for byte.

Owns: `plan_rewrite` (given a client's JSON body, the body sent upstream instead and the `Rewrite`
that undoes it: logprobs with the top-k the checker needs when the client asked none, and the token
id fields vLLM offers, `return_token_ids` and `return_tokens_as_token_ids`), `strip_json` (one
response object, a stream chunk or a whole body, with the added fields taken off) and `SseRelay`
(a sampled stream re-framed event by event).

Why edits on the bytes rather than parse and re-serialise: a server's JSON has its own dialect
(vLLM's pydantic writes compact JSON with raw UTF-8 and its own float format; llama-cpp-python's
`json.dumps` writes `", "` and `\\uXXXX` escapes), and the client must get exactly what the server
would have sent without the proxy. So the spans of the added fields are found in the original text
with a small scanner and set back to `null` (`"logprobs": {...}` -> `"logprobs": null`, and
vLLM's `"token_ids"` / `"prompt_token_ids"`: what vLLM sends when they were not asked for); every
other byte is the server's own. Standard library only. Does not own the HTTP side (proxy.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Extra fields vLLM understands; an upstream that rejects them (HTTP 400) gets the request again
# without them, and the proxy remembers not to send them again.
ID_FIELDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}
ADDED_KEYS = ("token_ids", "prompt_token_ids")  # what return_token_ids fills in a choice (and a chat's top level)
_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What was added to one sampled request: the fields (of the response object and of each choice)
    whose value goes back to `null`, which is what an engine sends for what was not asked."""

    null_keys: tuple[str, ...]

    @property
    def changes(self) -> bool:
        return bool(self.null_keys)


def client_asked_logprobs(body: dict[str, Any], chat: bool) -> bool:
    value = body.get("logprobs")
    if chat:
        return value is True
    return value is True or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def plan_rewrite(body: dict[str, Any], chat: bool, *, top: int, ids: bool) -> tuple[dict[str, Any], Rewrite]:
    """The body to send upstream for a sampled request, and how to undo it on the response.

    `top`: alternatives per token the checker asks for when the client asked no logprobs; `ids`:
    also ask for the engine's token ids (vLLM). A client that asked for logprobs keeps its own
    fields (its logprobs are what it sees, so they are not touched); then only `return_token_ids`
    is added (`return_tokens_as_token_ids` would rewrite its token strings).
    """
    sent = dict(body)
    asked = client_asked_logprobs(body, chat)
    nulls: list[str] = []
    if not asked:
        if chat:
            sent["logprobs"], sent["top_logprobs"] = True, top
        else:
            sent["logprobs"] = top
        nulls.append("logprobs")
    if ids:
        if not body.get("return_token_ids"):
            sent["return_token_ids"] = True
            nulls += ADDED_KEYS
        if not asked and "return_tokens_as_token_ids" not in body:
            sent["return_tokens_as_token_ids"] = True
    return sent, Rewrite(tuple(nulls))


# --- the scanner ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Member:
    """One `"key": value` of an object: where the key starts and where its value starts and ends."""

    key: str
    key_start: int
    value_start: int
    value_end: int


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _members(text: str, i: int) -> tuple[list[_Member], int]:
    """The members of the object starting at `text[i] == '{'`, and the index after its `}`."""
    out: list[_Member] = []
    i = _skip(text, i + 1)
    if text[i] == "}":
        return out, i + 1
    while True:
        key_start = i
        key, i = json.decoder.scanstring(text, i + 1)
        i = _skip(text, i)
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        value_start = _skip(text, i + 1)
        _, value_end = _DECODER.raw_decode(text, value_start)
        out.append(_Member(key, key_start, value_start, value_end))
        i = _skip(text, value_end)
        if text[i] == "}":
            return out, i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or '}}' at {i}")
        i = _skip(text, i + 1)


def _elements(text: str, i: int) -> list[int]:
    """The start index of each element of the array starting at `text[i] == '['`."""
    starts: list[int] = []
    i = _skip(text, i + 1)
    if text[i] == "]":
        return starts
    while True:
        starts.append(i)
        _, end = _DECODER.raw_decode(text, i)
        i = _skip(text, end)
        if text[i] == "]":
            return starts
        i = _skip(text, i + 1)


def _edits(text: str, start: int, rw: Rewrite, top_level: bool) -> list[tuple[int, int]]:
    """The value spans to set to null in the object at `start` (and in each of its choices)."""
    members, _ = _members(text, start)
    edits: list[tuple[int, int]] = []
    for m in members:
        if m.key in rw.null_keys and text[m.value_start:m.value_end] != "null":
            edits.append((m.value_start, m.value_end))
        elif top_level and m.key == "choices" and text[m.value_start] == "[":
            for el in _elements(text, m.value_start):
                if text[el] == "{":
                    edits += _edits(text, el, rw, top_level=False)
    return edits


def strip_json(text: str, rw: Rewrite) -> str:
    """`text` (one response object) with what `rw` added taken off; every other character kept.

    ValueError when it is not a JSON object (the caller then passes it unchanged: an error body).
    """
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "{":
        raise ValueError("not a JSON object")
    out, pos = [], 0
    for a, b in sorted(_edits(text, i, rw, top_level=True)):
        out.append(text[pos:a])
        out.append("null")
        pos = b
    out.append(text[pos:])
    return "".join(out)


class SseRelay:
    """A sampled stream, re-framed: bytes in as they arrive, complete events out with the added
    fields taken off their `data:` JSON (everything else, comments, `[DONE]` and the framing, kept).

    """

    def __init__(self, rw: Rewrite) -> None:
        self.rw = rw
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        """The bytes for the client: every event `data` completes, rewritten."""
        self._buf += data
        out: list[bytes] = []
        while (cut := event_end(self._buf)) is not None:
            event, self._buf = self._buf[:cut], self._buf[cut:]
            out.append(self._event(event))
        return b"".join(out)

    def tail(self) -> bytes:
        """What is left when the stream ends (an unterminated last event), unchanged."""
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for n, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            body = line[5:]
            lead = len(body) - len(body.lstrip(b" "))
            data = body[lead:].rstrip(b"\r")
            end = body[lead + len(data):]
            if not data.startswith(b"{"):
                continue
            try:
                new = strip_json(data.decode("utf-8"), self.rw).encode("utf-8")
            except (ValueError, UnicodeDecodeError, IndexError):
                continue  # not a chunk we understand: the client gets it as sent
            lines[n] = b"data:" + body[:lead] + new + end
        return b"\n".join(lines)


def event_end(buf: bytes) -> int | None:
    """The index just past the first complete event (blank-line terminated) in `buf`, or None."""
    best = None
    for sep in (b"\n\n", b"\r\n\r\n"):
        i = buf.find(sep)
        if i >= 0 and (best is None or i + len(sep) < best):
            best = i + len(sep)
    return best
