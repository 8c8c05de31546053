"""`probe`: drive a running OpenAI-compatible server and record what it did as a `.wbtrace` file.

Owns the run: the server's identity and `/metrics` before and after, one streamed request per
`ProbeRequest` (the first alone, so the fields the server accepts are settled once; the rest
`concurrency` at a time), each token written to the trace the moment its chunk arrives, the
progress line, and the summary of what failed. Trace layout (the ordinary schema, `meta.source =
"external"`): a step is one received chunk, numbered in arrival order across all requests;
`request.added` (prompt, the reference tokenizer's prompt ids, the sampling fields sent),
`token` per output token (`source` says how its id was obtained: `external` = the server's own
id, `external_recovered` = looked up from its bytes, `external_unknown` = -1), a `stamp` with stage
`otlp` holding the server's spans when a receiver joined them, and `request.finished` (text,
finish and stop reason, usage, client timings, error). What an external server does not report
(batches, forwards, sampling stages, KV, detokenizer, finish checks) is listed in
`meta.not_recorded`; viewers show those as not recorded. The API key is sent, never written.
Does not own HTTP parsing (sse_stream.py), token ids (token_ids.py) or identity (identity.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from workbench.external import identity as ident
from workbench.external.recording import (
    added_event,
    apply_chunk,
    external_meta,
    finished_event,
    token_event,
)
from workbench.external.records import ProbeRequest, ProbeResult, RequestRecord
from workbench.external.sse_stream import ChunkTokens, StreamError, build_body, stream_request
from workbench.external.token_ids import TokenIds, load_reference_tokenizer, prompt_ids
from workbench.trace.events import Stamp

API_KEY_ENV = "WORKBENCH_API_KEY"
FATAL_STATUS = {401: "check --api-key or $WORKBENCH_API_KEY", 403: "check --api-key or $WORKBENCH_API_KEY",
                404: "check the URL and --model"}


def probe(url: str, requests: list[ProbeRequest], out: str | Path, *, model: str | None = None,
          concurrency: int = 8, top_logprobs: int = 20, max_tokens: int = 64, api_key: str | None = None,
          otlp: Any = None, tokenizer: Any = None, progress: bool = True, defaults: dict[str, Any] | None = None,
          timeout: float = 120.0) -> ProbeResult:
    """Send every request to the server at `url`, streaming, and write the trace `out` as it goes.

    `tokenizer`: the reference tokenizer (an object, or a model spec; default `smollm2`).
    `defaults`: sampling fields for every request (a request's own `params` win); temperature is 0
    (greedy) unless set, so that a server's own default never decides what is compared. `api_key`
    (default `$WORKBENCH_API_KEY`) is sent as a bearer token and never recorded. `otlp`: an object
    with `spans_for(request_id)` (workbench.external.otlp), asked after each request. Returns the
    result even when requests failed (`result.errors`); raises ValueError for bad arguments.
    """
    if not requests:
        raise ValueError("probe: no requests given")
    if not 1 <= concurrency <= 256:
        raise ValueError(f"concurrency must be in [1, 256], got {concurrency}")
    if not 0 <= top_logprobs <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {top_logprobs}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    tok = load_reference_tokenizer(tokenizer or "smollm2") if tokenizer is None or isinstance(tokenizer, str) else tokenizer
    run = _ProbeRun(url, requests, Path(out), model=model, concurrency=concurrency, top_logprobs=top_logprobs,
                    max_tokens=max_tokens, api_key=api_key or os.environ.get(API_KEY_ENV), otlp=otlp, tokenizer=tok,
                    progress=progress, defaults={"temperature": 0.0, **(defaults or {})}, timeout=timeout)
    return _run_sync(run.run)


def _run_sync(coro_fn: Any) -> Any:
    """asyncio.run, also from inside a running loop (a notebook): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(coro_fn())))
    thread.start()
    thread.join()
    return box["r"]


def base_url(url: str) -> str:
    """`http://host:port` from what users paste (`.../v1`, a trailing slash)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class _ProbeRun:
    def __init__(self, url: str, requests: list[ProbeRequest], out: Path, *, model: str | None, concurrency: int,
                 top_logprobs: int, max_tokens: int, api_key: str | None, otlp: Any, tokenizer: Any,
                 progress: bool, defaults: dict[str, Any], timeout: float) -> None:
        self.url = base_url(url)
        self.requests, self.out, self.model = requests, out, model
        self.concurrency, self.top_logprobs, self.max_tokens = concurrency, top_logprobs, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.otlp, self.tokenizer, self.ids = otlp, tokenizer, TokenIds(tokenizer)
        self.progress, self.defaults, self.timeout = progress, defaults, timeout
        self.run_id = uuid.uuid4().hex[:8]
        self.extras: dict[str, Any] = {"return_tokens_as_token_ids": True, "return_token_ids": True}
        self.fallbacks: list[str] = []
        self.fatal: str | None = None  # set when no later request can succeed (logprobs refused)
        self.step = 0
        self.writer: Any = None
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self._last_progress = 0.0

    # --- the run -------------------------------------------------------------------------------

    async def run(self) -> ProbeResult:
        from workbench.trace.store import TraceWriter

        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            identity = ident.server_identity(client, self.headers)
            self.model = self.model or ident.first_model(identity)
            if self.model is None:
                status = (identity.get("models") or {}).get("status")
                if status in FATAL_STATUS:
                    raise ValueError(f"probe: {self.url}/v1/models answered HTTP {status}: {FATAL_STATUS[status]}")
                raise ValueError(f"probe: {self.url}/v1/models lists no model ({identity.get('models')}); "
                                 "is the server up? give --model NAME")
            metrics_before = ident.scrape_metrics(client, self.headers)
        self.writer = TraceWriter(self.out, self._meta(identity, metrics_before))
        errors: list[str] = []
        try:
            self.records = [self._record(i, r) for i, r in enumerate(self.requests)]
            limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
            timeout = httpx.Timeout(self.timeout, connect=10.0)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                await self._send(client, self.records[0])  # alone: it settles which fields the server takes
                sem = asyncio.Semaphore(self.concurrency)

                async def one(rec: RequestRecord) -> None:
                    async with sem:
                        await self._send(client, rec)

                await asyncio.gather(*(one(r) for r in self.records[1:]))
        finally:
            self._end_progress()
            with httpx.Client(base_url=self.url, timeout=10.0) as client:
                metrics_after = ident.scrape_metrics(client, self.headers)
            errors = [f"{r.req_id}: {r.error}" for r in self.records if r.error]
            self.writer.set_meta("external", {**self._external_meta(identity, metrics_before),
                                              "metrics_after": metrics_after,
                                              "metrics_delta": ident.metrics_delta(metrics_before, metrics_after),
                                              "fallbacks": self.fallbacks, "errors": errors[:50]})
            self.writer.close()
        return ProbeResult(self.out, self.url, self.model, self.records, errors, list(self.fallbacks))

    def _record(self, i: int, req: ProbeRequest) -> RequestRecord:
        # A UUID in form (llama.cpp's server answers 400 to any other X-Request-Id), readable as
        # <run id>-0000-4000-8000-<request index>.
        req_id = f"{self.run_id}-0000-4000-8000-{i:012d}"
        _, body = build_body(req, self.model or "", self.defaults, top_logprobs=self.top_logprobs,
                             max_tokens=self.max_tokens, extras={})
        ids = prompt_ids(self.tokenizer, req.prompt, req.messages)
        rec = RequestRecord(req_id=req_id, index=i, request=req, body=body, prompt_ids=ids)
        sampling = {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options", "prompt", "messages")}
        params = {**sampling, "endpoint": "chat" if req.is_chat else "completions",
                  "greedy": is_greedy(sampling)}
        self.writer.write(added_event(self.step, rec, params))
        return rec

    async def _send(self, client: httpx.AsyncClient, rec: RequestRecord) -> None:
        if self.fatal is not None:
            rec.error = f"not sent: {self.fatal}"
        else:
            try:
                await self._stream_with_fallback(client, rec)
            except StreamError as exc:
                rec.error = str(exc)
                if exc.status in FATAL_STATUS:  # every later request would fail the same way
                    self.fatal = f"{exc} ({FATAL_STATUS[exc.status]})"
                    rec.error = self.fatal
                elif exc.status is not None and exc.status < 500 and await self._refuses_logprobs(client, rec):
                    self.fatal = f"the server refuses logprobs ({exc}); probe needs them to compare tokens"
                    rec.error = self.fatal
            except Exception as exc:  # a bug in parsing a strange server: keep the run and the trace
                rec.error = f"{type(exc).__name__}: {exc}"
        rec.done = time.perf_counter()
        if self.otlp is not None:
            try:
                rec.spans = self.otlp.spans_for(rec.req_id)
            except Exception as exc:  # the receiver is optional; its failure must not lose the request
                rec.spans = {"error": f"{type(exc).__name__}: {exc}"}
            self.writer.write(Stamp(step=self.step, req_id=rec.req_id, t=rec.done, stage="otlp",
                                    detail={"spans": rec.spans}))
        self._finish(rec)
        self._show_progress(force=True)

    async def _stream_with_fallback(self, client: httpx.AsyncClient, rec: RequestRecord) -> None:
        while True:
            extras = dict(self.extras)
            if extras.get("return_tokens_as_token_ids"):
                extras["request_id"] = rec.req_id  # vLLM's own request id then matches X-Request-Id
            path, body = build_body(rec.request, self.model or "", self.defaults, top_logprobs=self.top_logprobs,
                                    max_tokens=self.max_tokens, extras=extras)
            headers = {**self.headers, "X-Request-Id": rec.req_id}
            rec.sent = time.perf_counter()
            try:
                await stream_request(client, self.url + path, body, headers, rec.request.is_chat,
                                     lambda resp: self._opened(rec, resp), lambda c, t: self._chunk(rec, c, t))
                return
            except StreamError as exc:
                if exc.status == 400 and self.extras and not rec.tokens:
                    self.fallbacks.append(f"the server rejected {sorted(self.extras)} ({exc}); token ids are "
                                          "recovered from token bytes through the reference tokenizer")
                    self.extras = {}
                    continue
                raise

    async def _refuses_logprobs(self, client: httpx.AsyncClient, rec: RequestRecord) -> bool:
        """Does the same request succeed without logprobs? Then the server refuses them."""
        path, body = build_body(rec.request, self.model or "", self.defaults, top_logprobs=0, max_tokens=1, extras={})
        body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs", "stream_options")}
        body["stream"] = False
        try:
            resp = await client.post(self.url + path, json=body, headers=self.headers)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    # --- what arrives ------------------------------------------------------------------------

    def _opened(self, rec: RequestRecord, resp: httpx.Response) -> None:
        rec.status = resp.status_code
        rec.headers = ident.safe_headers(resp.headers)
        rec.server_request_id = resp.headers.get("x-request-id")

    def _chunk(self, rec: RequestRecord, chunk: ChunkTokens, now: float) -> None:
        tokens = apply_chunk(rec, chunk, now, self.ids)
        if not tokens:
            return
        self.step += 1
        for token in tokens:
            self.writer.write(token_event(self.step, rec.req_id, token))
        self._show_progress()

    def _finish(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.text and not rec.tokens:
            rec.error = "the server sent text but no logprobs (it ignored logprobs=true); nothing to compare"
        self.writer.write(finished_event(self.step, rec))
        self.writer.flush()  # a killed probe keeps every finished request

    # --- meta and progress -------------------------------------------------------------------

    def _external_meta(self, identity: dict[str, Any], metrics_before: dict[str, Any]) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "identity": identity, "metrics_before": metrics_before,
                "concurrency": self.concurrency, "top_logprobs": self.top_logprobs, "max_tokens": self.max_tokens,
                "defaults": self.defaults, "run_id": self.run_id, "otlp": self.otlp is not None}

    def _meta(self, identity: dict[str, Any], metrics_before: dict[str, Any]) -> dict[str, Any]:
        return external_meta(self.tokenizer, self.model, self.url, self._external_meta(identity, metrics_before))

    def _show_progress(self, force: bool = False) -> None:
        now = time.perf_counter()
        tty = sys.stderr.isatty()  # a log file gets a line every 5 s, a terminal one line redrawn
        if not self.progress or (not force and now - self._last_progress < (0.2 if tty else 5.0)):
            return
        if not tty and force and now - self._last_progress < 5.0:
            return
        self._last_progress = now
        done = sum(1 for r in self.records if r.done is not None)
        failed = sum(1 for r in self.records if r.error)
        tokens = sum(len(r.tokens) for r in self.records)
        line = (f"probe {self.url}  {done}/{len(self.records)} requests  {tokens} tokens"
                f"  {failed} failed  {now - self.t0:.1f} s")
        sys.stderr.write("\r" + line.ljust(78) if tty else line + "\n")
        sys.stderr.flush()

    def _end_progress(self) -> None:
        if self.progress:
            self._last_progress = 0.0
            self._show_progress(force=True)
            if sys.stderr.isatty():
                sys.stderr.write("\n")
            sys.stderr.flush()


def is_greedy(params: dict[str, Any]) -> bool:
    """A request is greedy when its temperature is 0 (or top_k is 1): the engine must take the argmax."""
    temperature = params.get("temperature")
    return (isinstance(temperature, (int, float)) and temperature == 0) or params.get("top_k") == 1
