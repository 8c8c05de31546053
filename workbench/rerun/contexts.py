"""The batch contexts bisect and behaves-like try beside the dtypes: the reference model (float32,
exact kernels) run through this engine's real scheduler alone, batched with the trace's other
requests, with the prompt's prefix served from the prefix cache, or with chunked prefill of N tokens.

Owns: the context names (`alone`, `batched`, `prefix-cache`, `chunked:N`; `parse_context`), which of
them apply to a request (`default_contexts`: chunk sizes that really split its prompt, batched only
when the trace has other requests), and running one (`run_context`): an `Engine` on the reference's
loaded weights with the context's `EngineArgs`, the request's recorded tokens forced at every output
position up to the one asked for (`Engine.force_token`: teacher forcing through the engine's own
prefill, decode and batching), giving per output position the log-probabilities of the tokens asked
for, and, when asked, the residual stream of the row that chose one position (the engine's capture,
`Engine(capture=...)`). Nothing here imitates the engine: the contexts differ only in EngineArgs and
in what else is submitted. Does not own the fit (behaves_like.py) or the per-layer table (bisect.py).

- `alone`: the request by itself, its whole prompt in one prefill chunk.
- `batched`: every request of the trace submitted together (each forced to its own recorded tokens,
  so the batches evolve as recorded when they arrived together), the request among them.
- `prefix-cache`: the trace's other request sharing the longest prompt prefix with it (at least the
  cache's minimum match; else the request's own prompt, a repeat) run to the end first, then the
  request alone with `prefix_cache=True`: the shared prefix's K/V is copied from the cache and only
  the rest is prefilled.
- `chunked:N`: the request alone with `chunk_size=N`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTEXT_NAMES = ("alone", "batched", "prefix-cache", "chunked:N")
CHUNK_LADDER = (8, 16, 32, 64, 128, 256, 512)  # default chunk sizes, those below the prompt's length
MAX_CHUNK = 1 << 20
PREFIX_MIN_MATCH = 16  # engine/sched/prefix_cache.py PrefixCache.MIN_MATCH: shorter prefixes are recomputed


@dataclass(frozen=True, slots=True)
class Context:
    name: str  # as the user writes it: alone, batched, prefix-cache, chunked:N
    kind: str  # alone | batched | prefix-cache | chunked
    chunk: int | None = None

    def describe(self) -> str:
        return {"alone": "the reference run alone", "batched": "the reference run batched with the trace's requests",
                "prefix-cache": "the reference run with its prompt prefix from the prefix cache",
                "chunked": f"the reference run with chunked prefill of {self.chunk}"}[self.kind]


def is_context(name: str) -> bool:
    return isinstance(name, str) and (name in ("alone", "batched", "prefix-cache") or name.startswith("chunked:"))


def parse_context(name: str) -> Context:
    """`alone`, `batched`, `prefix-cache` or `chunked:N` (N an int in [1, 2^20]); ValueError otherwise."""
    if name in ("alone", "batched", "prefix-cache"):
        return Context(name, name)
    if isinstance(name, str) and name.startswith("chunked:"):
        raw = name.split(":", 1)[1]
        if raw.isdigit() and 1 <= int(raw) <= MAX_CHUNK:
            return Context(f"chunked:{int(raw)}", "chunked", int(raw))
        raise ValueError(f"context {name!r}: chunked:N needs N an int in [1, {MAX_CHUNK}] (prefill chunk size)")
    raise ValueError(f"context must be one of {', '.join(CONTEXT_NAMES)}, got {name!r}")


@dataclass(slots=True)
class Request:
    """A recorded request as a context re-runs it: its prompt and recorded tokens."""

    req_id: str
    prompt_ids: list[int]
    tokens: list[int]


@dataclass(slots=True)
class ContextRun:
    """What one context gave for the request: per output position {token id: logprob} of the tokens
    asked for, and the captured residual `[layers + 1, hidden]` (float32) of the row that chose
    `capture_at` (None when not asked)."""

    context: Context
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    top: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # per position the top-2 (id, logprob)
    residual: Any = None
    note: str = ""


def default_contexts(target: Request, others: list[Request]) -> list[str]:
    """The contexts that can differ from `alone` for this request: batched when the trace has other
    requests, the prefix cache when the prompt is long enough to be matched, and each ladder chunk
    size that splits the prompt."""
    out = ["alone"]
    if others:
        out.append("batched")
    if len(target.prompt_ids) > PREFIX_MIN_MATCH:
        out.append("prefix-cache")
    out += [f"chunked:{n}" for n in CHUNK_LADDER if n < len(target.prompt_ids)]
    return out


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _warm_up(target: Request, others: list[Request]) -> Request:
    """The request whose finished KV the prefix cache serves the target from."""
    best = max(others, key=lambda o: _shared_prefix(o.prompt_ids, target.prompt_ids), default=None)
    if best is not None and _shared_prefix(best.prompt_ids, target.prompt_ids) >= PREFIX_MIN_MATCH:
        return best
    return Request(target.req_id + "-earlier", list(target.prompt_ids), list(target.tokens[:1]))


def run_context(loaded: Any, name: str, requests: list[Request], req_id: str, upto: int,
                token_ids: list[int], capture_at: int | None = None) -> ContextRun:
    """Teacher-force request `req_id`'s recorded tokens 0..upto through an engine on `loaded` in context
    `name` (`requests`: the trace's requests in arrival order, that one among them); the
    log-probabilities of `token_ids` (and of each chosen token) at every output position."""
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import MAX_TOKEN_IDS_LOGPROB
    from workbench.trace.recorder import MemorySink

    ctx = parse_context(name)
    target = next(r for r in requests if r.req_id == req_id)
    others = [r for r in requests if r.req_id != req_id]
    if not 0 <= upto < len(target.tokens):
        raise ValueError(f"context run: upto must be in [0, {len(target.tokens)}), got {upto}")
    n_prompt = len(target.prompt_ids)
    args, note = _engine_args(ctx, str(loaded.device), n_prompt)
    capture = None
    sink = None
    if capture_at is not None:
        capture = {"positions": upto + 1, "what": ["hidden"]}
        sink = MemorySink()
    run = ContextRun(ctx, note=note)
    with Engine(loaded, args, trace_level="summary" if sink else "off", trace_sinks=[sink] if sink else None) as e:
        wanted = tuple(dict.fromkeys(t for t in token_ids if 0 <= t < e.vocab_size))[:MAX_TOKEN_IDS_LOGPROB]
        if ctx.kind == "prefix-cache":
            warm = _warm_up(target, others)
            _submit(e, warm, len(warm.tokens) - 1)
            _drain(e)
            cached = min(_shared_prefix(warm.prompt_ids, target.prompt_ids), n_prompt - 1)
            run.note = f"{cached} prompt tokens from the prefix cache (computed by {warm.req_id})"
        rid, skipped = None, 0
        for r in requests if ctx.kind == "batched" else [target]:  # in arrival order: the rows as recorded
            if r is target:
                rid = _submit(e, target, upto, wanted, capture)
                continue
            try:
                _submit(e, r, len(r.tokens) - 1)
            except ValueError:  # add_request refused it (e.g. longer than the reference's context): left out
                skipped += 1
        if skipped:
            run.note = f"{skipped} of the trace's requests could not be batched with it"
        _drain(e)
        out = e.finished[rid]
    for p in range(upto + 1):
        got = dict(out.token_ids_logprobs[p]) if out.token_ids_logprobs and p < len(out.token_ids_logprobs) else {}
        lp = out.logprobs[p] if out.logprobs and p < len(out.logprobs) else None
        if lp is not None and lp.logprob is not None:
            got.setdefault(int(lp.token_id), float(lp.logprob))
            run.top[p] = [(int(t[0]), float(t[2])) for t in lp.top_logprobs]
        run.logprobs[p] = got
    if sink is not None:
        import numpy as np

        name_ = next((ev.tensors.get("hidden") for ev in sink.events if ev.kind == "capture"
                      and ev.req_id == rid and ev.position == capture_at), None)
        if name_ is not None:
            run.residual = np.asarray(sink.tensors[name_], dtype=np.float32)
    return run


def _engine_args(ctx: Context, device: str, n_prompt: int) -> tuple[Any, str]:
    """The EngineArgs of a context (the engine's defaults otherwise) and a note when it changes nothing."""
    from workbench.engine.config import EngineArgs

    base = EngineArgs(device=device)
    if ctx.kind == "batched":  # the engine's defaults: chunks and budget as a batch of the trace's requests met them
        return base, ""
    whole = max(base.chunk_size, n_prompt)  # alone: the prompt in one chunk, whatever its length
    args = base.replace(chunk_size=whole, max_batch_tokens=max(base.max_batch_tokens, whole))
    if ctx.kind == "prefix-cache":
        return args.replace(prefix_cache=True), ""
    if ctx.kind == "chunked":
        note = f"the prompt ({n_prompt} tokens) fits one chunk of {ctx.chunk}: the same as alone" \
            if ctx.chunk >= n_prompt else ""
        return args.replace(chunk_size=ctx.chunk, max_batch_tokens=max(ctx.chunk, base.max_batch_tokens)), note
    return args, ""


def _submit(engine: Any, req: Request, upto: int, token_ids: tuple[int, ...] = (), capture: Any = None) -> str:
    from workbench.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=upto + 1, ignore_eos=True, logprobs=True,
                            top_logprobs=2, token_ids_logprob=token_ids)
    (rid,) = engine.add_request(list(req.prompt_ids), params, req_id=f"ctx-{req.req_id}", capture=capture)
    for p in range(upto + 1):
        engine.force_token(rid, p, int(req.tokens[p]))
    return rid


def _drain(engine: Any) -> None:
    while engine.has_work():
        engine.step()
