"""What a server streamed, as trace events: the record-writing shared by `probe` and `watch`.

Owns: folding one parsed SSE chunk into a `RequestRecord` (`apply_chunk`: text, usage, finish and
stop reason, the server's prompt ids and response id, and each reported token with its id resolved
through `TokenIds`), and the events and meta an external trace is made of (`added_event`,
`token_event`, `finished_event`, `external_meta`). Does not own sending requests (probe.py,
watch/proxy.py) or the trace file (workbench/trace/store.py).
"""

from __future__ import annotations

import platform
import time
from typing import Any

from workbench.external.records import ID_RECOVERED, ID_SERVER, ProbeToken, RequestRecord
from workbench.external.sse_stream import ChunkTokens
from workbench.external.token_ids import TokenIds
from workbench.trace.events import RequestAdded, RequestFinished, TokenChosen

SOURCES = {ID_SERVER: "external", ID_RECOVERED: "external_recovered"}
NOT_RECORDED = ("schedule", "forward_batch", "forward", "logits", "sampling", "kv", "spec.draft", "spec.verify",
                "detok", "finish")


def apply_chunk(rec: RequestRecord, chunk: ChunkTokens, now: float, ids: TokenIds) -> list[ProbeToken]:
    """Fold one chunk into `rec`; returns the tokens it carried (already appended to `rec.tokens`)."""
    rec.chunks.append(now)
    rec.text += chunk.text
    if chunk.prompt_token_ids:
        rec.server_prompt_ids = [int(t) for t in chunk.prompt_token_ids]
    if chunk.usage:
        rec.usage = dict(chunk.usage)
    if chunk.finish_reason is not None:
        rec.finish_reason = chunk.finish_reason
        rec.stop_reason = chunk.stop_reason
    if chunk.response_id and rec.server_request_id is None:
        rec.server_request_id = chunk.response_id
    new = []
    for reported in chunk.tokens:
        if reported.token_id is not None:
            tid, how = reported.token_id, ID_SERVER
        else:
            tid, how = ids.resolve(reported.text, reported.raw_bytes)
        text = ids.text_of(tid) if reported.text.startswith("token_id:") else reported.text
        top = []
        for alt_text, alt_bytes, alt_lp in reported.top:
            alt_id, _ = ids.resolve(alt_text, alt_bytes)
            top.append([alt_id, alt_lp, ids.text_of(alt_id) if alt_text.startswith("token_id:") else alt_text])
        token = ProbeToken(len(rec.tokens), tid, text, reported.logprob, top, how, now, len(rec.chunks) - 1)
        rec.tokens.append(token)
        new.append(token)
    return new


def token_event(step: int, req_id: str, token: ProbeToken) -> TokenChosen:
    return TokenChosen(step=step, req_id=req_id, t=token.received, position=token.position, token_id=token.token_id,
                       text=token.text, logprob=token.logprob, rank=None, top_logprobs=token.top,
                       source=SOURCES.get(token.id_source, "external_unknown"))


_REQUESTED = object()


def added_event(step: int, rec: RequestRecord, params: dict[str, Any], *, prompt: Any = _REQUESTED) -> RequestAdded:
    """`request.added`; `prompt` overrides the record's (a watched request that is no ProbeRequest)."""
    req = rec.request
    if prompt is _REQUESTED:
        prompt = req.messages if req.is_chat else req.prompt
    return RequestAdded(step=step, req_id=rec.req_id, t=rec.sent or time.perf_counter(), prompt=prompt,
                        prompt_ids=rec.prompt_ids, params=params)


def finished_event(step: int, rec: RequestRecord) -> RequestFinished:
    evidence = {"stop_reason": rec.stop_reason, "server_request_id": rec.server_request_id,
                "server_prompt_ids": rec.server_prompt_ids, "status": rec.status, "headers": rec.headers}
    return RequestFinished(
        step=step, req_id=rec.req_id, t=rec.done or time.perf_counter(), text=rec.text,
        output_ids=[t.token_id for t in rec.tokens], finish_reason=rec.finish_reason, matched_stop=rec.stop_reason,
        evidence=evidence, usage=rec.usage, timings=rec.timings(), error=rec.error)


def external_meta(tokenizer: Any, model: str | None, url: str, external: dict[str, Any]) -> dict[str, Any]:
    """The meta of a trace recorded from an external server (`meta.source = "external"`)."""
    return {
        "source": "external",
        "external": external,
        "model": {"name": model, "spec": None, "served_by": url},
        "reference": {"tokenizer": getattr(tokenizer, "workbench_spec", None) or getattr(tokenizer, "name_or_path", "")},
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", ""), "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id, "class": type(tokenizer).__name__},
        "not_recorded": list(NOT_RECORDED),
        "versions": {"workbench": "0.1.0", "python": platform.python_version()},
        "trace_level": "summary",
        "created": time.time(),
    }
