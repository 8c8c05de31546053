"""Token id -> text for the panes, without the engine.

Owns: the texts the trace itself carries (every `token` event's text and its top alternatives,
draft texts), and, when the trace names a local tokenizer folder (meta `tokenizer.name`) or the
user passes `--tokenizer`, decoding any id list with the `tokenizers` library (no transformers,
no torch, never the network). Without either, an unknown id is shown as `#id`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from workbench.trace.events import Event, SpecDraft, TokenChosen


class Vocab:
    """Known token texts plus an optional local tokenizer; safe to use from worker threads."""

    def __init__(self, tokenizer: Any = None) -> None:
        self._texts: dict[int, str] = {}
        self._lock = threading.Lock()
        self.tokenizer = tokenizer

    def learn(self, events: Iterable[Event]) -> None:
        """Remember the texts that token and draft events carry."""
        with self._lock:
            for event in events:
                if isinstance(event, TokenChosen):
                    self._texts[event.token_id] = event.text
                    for alt in event.top_logprobs:
                        if len(alt) >= 3 and isinstance(alt[0], int) and isinstance(alt[2], str):
                            self._texts.setdefault(alt[0], alt[2])
                elif isinstance(event, SpecDraft):
                    for tid, text in zip(event.tokens, event.texts):
                        if isinstance(text, str):
                            self._texts.setdefault(tid, text)

    def text(self, token_id: int | None) -> str | None:
        """The text of one id, or None when neither the trace nor a tokenizer knows it."""
        if token_id is None:
            return None
        with self._lock:
            known = self._texts.get(token_id)
        if known is not None or self.tokenizer is None:
            return known
        return self.decode([token_id])

    def piece(self, token_id: int | None) -> str:
        """The text of one id, or `#id` when unknown."""
        text = self.text(token_id)
        return text if text is not None else f"#{token_id}"

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of an id list (None when some id is unknown and there is no tokenizer)."""
        if self.tokenizer is not None:
            try:
                return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
            except Exception:  # an id outside this tokenizer's vocabulary (wrong --tokenizer)
                return None
        with self._lock:
            parts = [self._texts.get(int(i)) for i in ids]
        return None if any(p is None for p in parts) else "".join(parts)  # type: ignore[arg-type]


def tokenizer_folder(meta: dict[str, Any]) -> str | None:
    """The local folder a trace names as its tokenizer, if it exists here and holds tokenizer.json."""
    tok = meta.get("tokenizer")
    name = tok.get("name") if isinstance(tok, dict) else None
    if not isinstance(name, str) or not name:
        return None
    return name if os.path.isfile(os.path.join(name, "tokenizer.json")) else None


def load_tokenizer(path: str | None) -> Any:
    """A `tokenizers.Tokenizer` from a folder (or a tokenizer.json file); None if it cannot be read.

    Raises ValueError for an explicit path that does not exist, so `--tokenizer` typos are reported.
    """
    if path is None:
        return None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"--tokenizer: no tokenizer.json at {path!r}")
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(file)
    except Exception:  # a malformed file: fall back to the texts the trace carries
        return None
