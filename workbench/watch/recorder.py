"""The watch's traces: every proxied generation request, written to rolling `.wbtrace` files.

Owns: a thread that takes finished `Exchange`s from a bounded queue (full: the request is not
recorded, counted and said in /watch/status; traffic never waits), turns each into the events of
`probe`'s schema (workbench/external/recording.py: `request.added`, a `token` per reported token,
`request.finished`; `meta.source = "external"`), writes them to the current file and rotates:
past `max_bytes` the file is closed (it stays a complete trace any viewer opens) and a new one is
started; of the closed files the newest `keep` are kept. A sampled request's tokens then go to the
checker with the path of the file that holds them. Credentials never reach a trace: request
headers are not recorded, response headers through `identity.safe_headers`, body fields naming a
key or a secret dropped. Does not own the proxy (proxy.py) or the check (checker.py).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.external.check import Scored
from workbench.external.identity import safe_headers
from workbench.external.recording import added_event, apply_chunk, external_meta, finished_event, token_event
from workbench.external.records import ProbeRequest, RequestRecord
from workbench.watch.exchange import Exchange, safe_body
from workbench.watch.threads import yield_to_traffic

_HEAVY = ("prompt", "messages", "model", "stream", "stream_options", "tools", "response_format")


@dataclass(slots=True)
class CheckItem:
    """A sampled request for the checker: the tokens to score and the trace that holds them."""

    scored: Scored
    trace: str  # the file its rows go into
    received: float  # perf_counter() of its last chunk (the checker reports its lag)


class Recorder:
    """Rolling trace files fed from a bounded queue by the proxy; runs in a thread of its own."""

    def __init__(self, out_dir: str | os.PathLike[str], tokenizer: Any, *, upstream: str, model: str | None = None,
                 max_bytes: int = 64 << 20, keep: int = 8, capacity: int = 4096,
                 on_sampled: Callable[[CheckItem], None] | None = None) -> None:
        if max_bytes < 1 << 16:
            raise ValueError(f"trace size cap must be >= 65536 bytes, got {max_bytes}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 trace file, got {keep}")
        from workbench.external.token_ids import TokenIds

        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer, self.ids = tokenizer, TokenIds(tokenizer)
        self.upstream, self.model = upstream, model
        self.max_bytes, self.keep = max_bytes, keep
        self.on_sampled = on_sampled
        self.queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=capacity)
        self.capacity = capacity
        self.dropped = 0  # exchanges not recorded: the queue was full
        self.recorded = 0
        self.errors = 0  # exchanges whose recording failed (a bug or a strange server; the proxy is unaffected)
        self.last_error = ""
        self.files: list[str] = []  # every file of this run, oldest first (deleted ones removed)
        self._seq = 0
        self._step = 0
        self._writer: Any = None
        self._thread = threading.Thread(target=self._run, name="watch-recorder", daemon=True)
        self._thread.start()

    # --- the proxy's side (event loop) ---------------------------------------------------------

    def submit(self, ex: Exchange) -> bool:
        try:
            self.queue.put_nowait(ex)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self) -> None:
        """Record what is queued, then close the current file."""
        self.queue.put(None)
        self._thread.join(timeout=60)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every exchange queued so far is written (tests; shutdown)."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    @property
    def current(self) -> str | None:
        return self.files[-1] if self.files else None

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        yield_to_traffic(5)
        while True:
            ex = self.queue.get()
            try:
                if ex is None:
                    self._close_file()
                    return
                self._record(ex)
                self.recorded += 1
            except Exception as exc:  # keep recording the next ones
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self.queue.task_done()

    def _record(self, ex: Exchange) -> None:
        from workbench.external.token_ids import prompt_ids

        writer = self._open()
        body = safe_body(ex.body)
        request, prompt = _probe_request(body, ex.chat)
        try:
            ids = prompt_ids(self.tokenizer, request.prompt, request.messages) if request is not None else []
        except Exception:  # a template that rejects these messages: the server's own ids may still come
            ids = []
        rec = RequestRecord(req_id=ex.req_id, index=self.recorded, request=request or ProbeRequest(prompt="-"),
                            body=body, prompt_ids=ids, sent=ex.sent, status=ex.status,
                            headers=safe_headers(ex.headers), error=ex.error, done=ex.done)
        params = {k: v for k, v in body.items() if k not in _HEAVY}
        params |= {"endpoint": "chat" if ex.chat else "completions", "greedy": _greedy(body), "sampled": ex.sampled,
                   "stream": ex.stream}
        writer.write(added_event(self._step, rec, params, prompt=prompt))
        try:
            for now, chunk in ex.chunks():
                tokens = apply_chunk(rec, chunk, now, self.ids)
                if tokens:
                    self._step += 1
                    for token in tokens:
                        writer.write(token_event(self._step, rec.req_id, token))
        except ValueError as exc:
            rec.error = rec.error or f"unreadable response: {exc}"
        notes = [n for n, on in (("client disconnected; upstream request cancelled", ex.client_gone),
                                 ("response over the recording cap; its tail not recorded", ex.truncated)) if on]
        if notes:
            rec.error = "; ".join(filter(None, [rec.error, *notes]))
        writer.write(finished_event(self._step, rec))
        writer.flush()
        path = writer.path
        if ex.sampled and rec.tokens and self.on_sampled is not None and not ex.client_gone and ex.error is None:
            prompt_for_ref = rec.server_prompt_ids or rec.prompt_ids
            if prompt_for_ref:
                scored = Scored(rec.req_id, _greedy(body), list(prompt_for_ref),
                                [token_event(0, rec.req_id, t) for t in rec.tokens])
                self.on_sampled(CheckItem(scored, path, rec.tokens[-1].received))
        if _size(path) > self.max_bytes:
            self._close_file()

    # --- files -----------------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._writer is None:
            from workbench.trace.store import TraceWriter

            self._seq += 1
            name = time.strftime("watch-%Y%m%d-%H%M%S") + f"-{self._seq:04d}.wbtrace"
            path = str(self.dir / name)
            meta = external_meta(self.tokenizer, self.model, self.upstream,
                                 {"url": self.upstream, "model": self.model, "watch": True, "file_index": self._seq})
            self._writer = TraceWriter(path, meta)
            self._step = 0
            self.files.append(path)
            while len(self.files) > self.keep:
                old = self.files.pop(0)
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(old + suffix):
                        os.remove(old + suffix)
        return self._writer

    def _close_file(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


def _probe_request(body: dict[str, Any], chat: bool) -> tuple[ProbeRequest | None, Any]:
    """The request as a `ProbeRequest` when it is a text prompt or plain chat, and what to record as its prompt."""
    prompt = body.get("messages") if chat else body.get("prompt")
    try:
        return (ProbeRequest(messages=prompt) if chat else ProbeRequest(prompt=prompt)), prompt
    except ValueError:  # a list of prompts, token ids, multimodal parts: recorded as sent, not checked
        return None, prompt


def _greedy(body: dict[str, Any]) -> bool:
    t = body.get("temperature")
    return (isinstance(t, (int, float)) and t == 0) or body.get("top_k") == 1


def _size(path: str) -> int:
    return sum(os.path.getsize(path + s) for s in ("", "-wal") if os.path.exists(path + s))
