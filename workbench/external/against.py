"""`workbench diff T --against transformers`: record a peer's run of a trace's prompts, then diff.

Owns: choosing which recorded requests a peer can reproduce (greedy, n = 1, at least one token),
calling the peer's recorder with the same prompt token ids and each request's recorded length, and
saying which requests it skipped. The transformers recorder is imported here and nowhere else in
the CLI path, so moving it is a one-line change.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

from workbench.trace.reader import open_trace

PEERS = ("transformers",)


@dataclass(slots=True)
class PeerRun:
    path: str
    req_ids: list[str]
    skipped: dict[str, str]  # req_id -> why the peer cannot reproduce it


def _hf_recorder():
    from workbench.external.hf_generate import record_hf_trace  # the one place the HF recorder is imported

    return record_hf_trace


def record_peer(trace_path: str, peer: str, out: str | None = None) -> PeerRun:
    """Record `peer`'s greedy run of every reproducible request of `trace_path` into `out`
    (a temporary file when None), each limited to the number of tokens the trace recorded."""
    if peer not in PEERS:
        raise ValueError(f"--against must be one of {', '.join(PEERS)}, got {peer!r}")
    with open_trace(trace_path) as trace:
        model = trace.meta.get("model")
        if not isinstance(model, dict) or not model.get("spec"):
            raise ValueError(f"trace {trace_path!r} names no model (meta 'model'.spec): cannot run {peer} on it")
        lengths = {rid: len(toks) for rid, toks in _token_counts(trace).items()}
        keep, skipped = [], {}
        for r in trace.requests():
            params = r.added.params if r.added else {}
            if r.added is None:
                skipped[r.req_id] = "no request.added event"
            elif r.added.parent_id is not None:
                skipped[r.req_id] = "n > 1 sibling"
            elif params.get("temperature", 1.0) != 0:
                skipped[r.req_id] = f"sampled at temperature {params.get('temperature')}; {peer} runs greedy"
            elif not lengths.get(r.req_id):
                skipped[r.req_id] = "no output tokens"
            else:
                keep.append(r)
    if not keep:
        raise ValueError(f"trace {trace_path!r} has no greedy request {peer} could reproduce ({skipped})")
    if out is None:
        fd, out = tempfile.mkstemp(suffix=f".{peer}.wbtrace")
        os.close(fd)
        os.unlink(out)
    print(f"running {peer} generate() on {len(keep)} prompts ({model['spec']}) ...", file=sys.stderr, flush=True)
    _hf_recorder()(out, model["spec"], [list(r.added.prompt_ids) for r in keep],
                   max_new_tokens=[lengths[r.req_id] for r in keep], req_ids=[r.req_id for r in keep])
    return PeerRun(out, [r.req_id for r in keep], skipped)


def _token_counts(trace) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in trace.events(kind="token"):
        out.setdefault(e.req_id, []).append(e.position)
    return out
