"""`workbench resend`: the same traffic to another engine, recorded like `probe` records it.

Owns: reading a recorded trace's requests back (each one's prompt or chat, and the sampling fields
it was sent with: temperature, top-p, seeds, stops, max_tokens ...), changing fields the user asks
to (`set`: another engine's own knobs, such as llama.cpp's `repeat_penalty`), and probing the new
upstream with them into a new trace whose meta names the trace it was resent from and, per
request, the original request id (`meta.resent_from`), so `workbench diff T T2` lines them up. Does
not own the probe (probe.py) or the diff (trace/diff.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.external.records import SAMPLING_FIELDS, ProbeRequest, ProbeResult


@dataclass(slots=True)
class Recorded:
    """A trace's requests as they were sent, and the run's settings."""

    requests: list[ProbeRequest]
    req_ids: list[str]
    top_logprobs: int
    max_tokens: int
    tokenizer: str | None
    skipped: dict[str, str]  # request id -> why it cannot be resent


def recorded_requests(path: str | os.PathLike[str]) -> Recorded:
    """The requests of a probe trace (or this engine's own: text prompts and chats), as sent."""
    from workbench.trace.reader import open_trace

    with open_trace(path) as trace:
        meta = trace.meta
        infos = trace.requests()
    ext = meta.get("external") if isinstance(meta.get("external"), dict) else {}
    reqs, ids, skipped = [], [], {}
    top = ext.get("top_logprobs") if isinstance(ext.get("top_logprobs"), int) else 20
    max_tokens = ext.get("max_tokens") if isinstance(ext.get("max_tokens"), int) else 64
    for info in infos:
        added = info.added
        if added is None:
            continue
        prompt, params = added.prompt, dict(added.params or {})
        if "max_new_tokens" in params and "max_tokens" not in params:  # this engine's own trace
            params["max_tokens"] = params["max_new_tokens"]
        sampling = {k: v for k, v in params.items() if k in SAMPLING_FIELDS and v is not None}
        try:
            if isinstance(prompt, str) and prompt:
                reqs.append(ProbeRequest(prompt=prompt, params=sampling))
            elif isinstance(prompt, list) and prompt:
                reqs.append(ProbeRequest(messages=prompt, params=sampling))
            else:
                skipped[added.req_id] = "no prompt text recorded (an imported trace holds token ids only)"
                continue
        except ValueError as exc:
            skipped[added.req_id] = str(exc)
            continue
        ids.append(added.req_id)
    tok = (meta.get("reference") or {}).get("tokenizer") if isinstance(meta.get("reference"), dict) else None
    if not reqs:
        why = next(iter(skipped.values()), "the trace holds no requests")
        raise ValueError(f"resend: nothing to resend from {os.fspath(path)!r}: {why}")
    return Recorded(reqs, ids, top, max_tokens, tok if isinstance(tok, str) else None, skipped)


def parse_set(items: list[str]) -> dict[str, Any]:
    """`FIELD=VALUE` items (VALUE read as JSON, else as a string) into sampling fields."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in SAMPLING_FIELDS:
            raise ValueError(f"--set takes FIELD=VALUE with FIELD one of {', '.join(SAMPLING_FIELDS)}, got {item!r}")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def resend(trace: str | os.PathLike[str], to: str, out: str | os.PathLike[str], *, set_params: dict[str, Any] | None = None,
           top_logprobs: int | None = None, max_tokens: int | None = None, tokenizer: Any = None,
           **probe_args: Any) -> tuple[ProbeResult, Recorded]:
    """Send the requests recorded in `trace` to the server at `to` and record the trace `out`.

    Each request keeps its own sampling fields (seeds included); `set_params` overrides fields for
    every request. `top_logprobs`, `max_tokens` and the tokenizer default to the recorded run's.
    `probe_args` go to `probe` (model, concurrency, api_key, timeout, progress)."""
    from workbench.external.probe import probe

    rec = recorded_requests(trace)
    if set_params:
        bad = set(set_params) - set(SAMPLING_FIELDS)
        if bad:
            raise ValueError(f"resend: unknown sampling fields {sorted(bad)}; allowed: {', '.join(SAMPLING_FIELDS)}")
        rec.requests = [ProbeRequest(prompt=r.prompt, messages=r.messages, params={**r.params, **set_params})
                        for r in rec.requests]
    result = probe(to, rec.requests, out, top_logprobs=rec.top_logprobs if top_logprobs is None else top_logprobs,
                   max_tokens=rec.max_tokens if max_tokens is None else max_tokens,
                   tokenizer=tokenizer or rec.tokenizer, **probe_args)
    _stamp(Path(out), trace, rec, result, set_params or {})
    return result, rec


def _stamp(out: Path, trace: str | os.PathLike[str], rec: Recorded, result: ProbeResult, changed: dict[str, Any]) -> None:
    """Name the source trace (meta `resent_from`) and each request's original id (table `resent`)."""
    from workbench.trace.annotations import store_rows

    rows = [{"req_id": r.req_id, "original": old} for r, old in zip(result.records, rec.req_ids)]
    store_rows(out, "resent", "resent_from", {"trace": os.fspath(trace), "set": changed, "skipped": rec.skipped}, rows)
