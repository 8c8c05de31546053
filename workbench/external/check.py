"""`check_trace`: score a trace's outputs against the reference model by teacher forcing.

Owns: reading what an engine produced (any trace: a probe of an external server, or this engine's
own), scoring it with the reference (the unmodified transformers model run by this engine's
ModelRunner) in one batched prefill of prompt + output per request (the engine's prompt-logprob
path: `max_new_tokens=0`, `prompt_logprobs=True`, top-20, so every output position's logits come
from the same forward that a prefill would run), and classifying each position:

- greedy requests (temperature 0 or top_k 1): the first position whose token is not the
  reference's argmax is the divergence; it is a `near_tie` when the reference's own preference is
  under the tolerance (its argmax beats the engine's token by less than `tolerance` nats, i.e. the
  top-2 margin when the engine took the runner-up), otherwise `real`;
- sampled requests: any position whose reported logprob differs from the reference's by more than
  `tolerance` is a `logprob` divergence (the token itself was drawn, so it may differ).

With a measured noise floor (`floor`, external/floor.py) the constant tolerance gives way where the
engine's own run-to-run spread is larger: a greedy mismatch whose gap the engine's own noise can
flip is `floor` (inside the floor), a sampled logprob is a divergence only beyond both, and every
position records the floor's bound for its band. With `importance` thresholds (on by default for
imported rollouts) every position also gets its log importance ratio, reference − engine, and what
truncated / masked importance sampling would do there (external/importance.py).

Teacher forcing scores every position on the engine's own prefix, so positions after a divergence
are still meaningful. The results go into the trace's `checks` table (workbench/trace/checks.py).
Does not own the records and the table rendering (check_report.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.external.check_report import CheckReport, PositionCheck, RequestCheck, topk_divergence
from workbench.external.importance import (
    ImportanceReport,
    RatioVerdict,
    Thresholds,
    classify_ratio,
    processed_logprob,
)
from workbench.trace.checks import store_checks
from workbench.trace.events import TokenChosen
from workbench.trace.reader import open_trace

DEFAULT_TOLERANCE = 0.05  # nats; fp32 engines agree to ~1e-3, bf16 and quantized ones do not
REF_TOP = 20


@dataclass(slots=True)
class Scored:
    """One request as recorded: the ids the reference reads, and the engine's tokens to score."""

    req_id: str
    greedy: bool
    prompt_ids: list[int]
    tokens: list[TokenChosen]
    note: str = ""
    params: dict[str, Any] | None = None


def check_trace(path: str | Path, reference: str = "smollm2", *, tolerance: float = DEFAULT_TOLERANCE,
                store: bool = True, engine: Any = None, progress: bool = True, floor: Any = None,
                importance: Thresholds | None = None) -> CheckReport:
    """Teacher-force every request of the trace at `path` through `reference` and classify it.

    `engine`: an existing `Engine` on the reference (tests reuse one); otherwise one is loaded.
    `store`: write the results into the trace (`checks` table; an earlier check is replaced).
    `floor`: a measured `Floor` (or a path to its JSON file) to classify against.
    `importance`: TIS / MIS thresholds for the importance-ratio report (default for a trace made
    by `workbench import`: `Thresholds()`; otherwise none unless given).
    ValueError (TraceError) for an unreadable trace or a bad tolerance.
    """
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    path = os.fspath(path)
    with open_trace(path) as trace:
        source = str(trace.meta.get("source") or "engine")
        probed_with = (trace.meta.get("reference") or {}).get("tokenizer") if source == "external" else None
        todo = recorded_scored(trace)
        imported = isinstance(trace.meta.get("import"), dict)
    if floor is not None and not hasattr(floor, "bound"):
        from workbench.external.floor import load_floor

        floor = load_floor(floor)
    if importance is None and imported:
        importance = Thresholds()
    warnings = []
    reads_with = getattr(engine, "tokenizer_spec", None) or reference  # a server reference names its tokenizer
    if isinstance(probed_with, str) and probed_with and probed_with != reads_with:
        warnings.append(f"the probe read prompts and recovered token ids with the tokenizer of {probed_with!r}, "
                        f"not {reads_with!r}: ids may not mean the same tokens")
    if engine is None:
        from workbench.engine.engine import Engine

        if progress:
            print(f"check: loading reference {reference} ...", file=sys.stderr, flush=True)
        engine = Engine(reference, trace=None, trace_level="off")
    scored = [s for s in todo if s.tokens]
    if progress:
        n = sum(len(s.tokens) for s in scored)
        print(f"check: scoring {len(scored)} requests, {n} output tokens, in one batched prefill",
              file=sys.stderr, flush=True)
    ratios = ImportanceReport(importance) if importance is not None else None
    results = score(engine, todo, float(tolerance), floor, ratios)
    name = getattr(getattr(engine, "loaded", None), "name", None) or reference
    report = CheckReport(path=path, reference=f"{reference} ({name})" if name != reference else reference,
                         tolerance=float(tolerance), requests=results, source=source, warnings=warnings,
                         floor=floor.summary() if floor is not None else None, importance=ratios)
    if store:
        store_checks(path, report.summary(), report.rows())
    return report


def recorded_scored(trace: Any) -> list[Scored]:
    """Each request's prompt ids and tokens (latest per position), in arrival order."""
    tokens: dict[str, dict[int, TokenChosen]] = {}
    budget = trace.budget("the recorded tokens") if hasattr(trace, "budget") else None
    for event in trace.events(kind="token", budget=budget) if budget is not None else trace.events(kind="token"):
        if event.req_id is not None:
            tokens.setdefault(event.req_id, {})[event.position] = event
    out = []
    for info in trace.requests():
        if info.added is None:
            continue
        params = info.added.params or {}
        greedy = bool(params.get("greedy")) if "greedy" in params else _greedy(params)
        prompt = list(info.added.prompt_ids)
        note = ""
        evidence = info.finished.evidence if info.finished is not None else None
        server_ids = evidence.get("server_prompt_ids") if isinstance(evidence, dict) else None
        if isinstance(server_ids, list) and server_ids and all(isinstance(t, int) for t in server_ids):
            prompt = list(server_ids)  # what the server really read beats our rendering of it
        elif info.finished is not None and isinstance(info.finished.usage, dict):
            told = info.finished.usage.get("prompt_tokens")
            if isinstance(told, int) and told != len(prompt):
                note = f"server counted {told} prompt tokens, the reference tokenizer {len(prompt)}"
        by_pos = tokens.get(info.req_id, {})
        out.append(Scored(info.req_id, greedy, prompt, [by_pos[p] for p in sorted(by_pos)], note, params))
    return out


def _greedy(params: dict[str, Any]) -> bool:
    t = params.get("temperature")
    return (isinstance(t, (int, float)) and t == 0) or params.get("top_k") == 1


def score(engine: Any, todo: list[Scored], tolerance: float, floor: Any = None,
          ratios: ImportanceReport | None = None) -> list[RequestCheck]:
    """Teacher-force each request (prompt + output, one batched prefill) and classify every position."""
    from workbench.engine.sample.sampling_params import SamplingParams

    vocab = engine.vocab_size
    max_ctx = engine.max_context_len()
    inputs, kept = [], []
    for s in todo:
        ids = [t.token_id for t in s.tokens]
        cut = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), len(ids))
        if cut < len(ids):
            s.note = _join(s.note, f"scored up to position {cut}: token {ids[cut]} is not in the reference vocabulary")
        cut = min(cut, max(0, max_ctx - len(s.prompt_ids)))
        s.tokens = s.tokens[:cut]
        if s.tokens and s.prompt_ids:
            inputs.append(s.prompt_ids + [t.token_id for t in s.tokens])
            kept.append(s)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=True, top_logprobs=REF_TOP, temperature=0.0)
    outputs = engine.generate(inputs, [params] * len(inputs)) if inputs else []
    by_id = {s.req_id: out for s, out in zip(kept, outputs, strict=True)}
    text = engine.token_text if hasattr(engine, "token_text") else (lambda t: "")
    results = []
    for s in todo:
        out = by_id.get(s.req_id)
        rc = RequestCheck(s.req_id, s.greedy, note=s.note)
        if out is not None:
            rows = out.prompt_logprobs or []
            for tok in s.tokens:
                row = rows[len(s.prompt_ids) + tok.position]
                pc = _position(tok, row, text, s.greedy, tolerance, floor)
                if ratios is not None and tok.logprob is not None:
                    ratios.add(s.req_id, pc.position, _ratio(pc, row, s.params or {}, ratios.thresholds, tolerance))
                rc.positions.append(pc)
        _classify(rc)
        results.append(rc)
    return results


def _position(tok: TokenChosen, row: dict[str, Any], text: Any, greedy: bool, tolerance: float,
              floor: Any = None) -> PositionCheck:
    top = [(int(i), float(lp)) for i, _t, lp in row["top_logprobs"]]
    argmax, best = top[0]
    second = top[1][1] if len(top) > 1 else float("-inf")
    ref_lp = float(row["logprob"])
    delta = float(tok.logprob) - ref_lp if tok.logprob is not None else None
    engine_top = [(a[0], a[1]) for a in tok.top_logprobs if len(a) >= 2 and isinstance(a[1], (int, float))]
    kl, overlap = topk_divergence(engine_top, top)
    gap = best - ref_lp if tok.token_id != argmax else 0.0
    pc = PositionCheck(tok.position, tok.token_id, tok.text, tok.logprob, ref_lp, delta, argmax, text(argmax),
                       best - second, max(gap, 0.0), int(row["rank"]), kl, overlap)
    bound = 0.0
    if floor is not None:
        pc.floor = bound = float(floor.bound(tok.logprob if tok.logprob is not None else ref_lp))
    if greedy and tok.token_id != argmax:
        inside = floor is not None and pc.gap <= floor.flip_bound(best)
        pc.verdict = "floor" if inside else "near_tie" if pc.gap < tolerance else "real"
    elif not greedy and delta is not None and abs(delta) > max(tolerance, bound):
        pc.verdict = "logprob"
    return pc


def _ratio(pc: PositionCheck, row: dict[str, Any], params: dict[str, Any], thresholds: Thresholds,
           tolerance: float) -> RatioVerdict:
    """The position's importance ratio and what TIS / MIS do to it, written into `pc`."""
    t, top_p, top_k = params.get("temperature"), params.get("top_p"), params.get("top_k")
    t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 1.0
    top_p = float(top_p) if isinstance(top_p, (int, float)) and 0 < top_p <= 1 else 1.0
    top_k = int(top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) else -1
    processed = None
    if t > 0 and (t != 1.0 or top_p < 1.0 or top_k > 0):  # only then do processed and raw differ
        top = [(int(i), float(lp)) for i, _t, lp in row["top_logprobs"]]
        processed = processed_logprob(top, pc.token_id, t, top_p, top_k)
    v = classify_ratio(float(pc.engine_logprob), pc.ref_logprob, thresholds=thresholds, ref_processed=processed,
                       ref_margin=pc.ref_margin, rank=pc.rank, tolerance=tolerance)
    pc.log_ratio, pc.tis, pc.mis, pc.is_reason = v.log_ratio, v.tis, v.mis, v.reason
    return v


def _classify(rc: RequestCheck) -> None:
    """The request's first divergence and its class (greedy: token; sampled: logprob)."""
    first = next((p for p in rc.positions if p.verdict != "ok"), None)
    if first is not None:
        rc.first_divergence, rc.divergence_class = first.position, first.verdict


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
