"""Fork a recorded run at any token: `workbench fork T --at REQ:POSITION [--token ...] [--set ...]`.

Owns: resolving the branch point (a request and an output position of the parent trace) and the
forced token (`ID`, `TEXT` of one token, or `rank:N` of the recorded top-k there), re-executing the
parent with every request at its recorded arrival step (replay's `run_recorded`), forcing the token
(`Engine.force_token`) and applying the changed parameters (`Engine.update_params`) from that
position on, and writing the fork as a trace whose meta `fork` names the parent and the branch
point. The result carries the parent-vs-fork diff. Common random numbers: the fork replays the
parent's recorded uniform draw at every sampled position of every request (`Engine.use_draws`), so a
sampled request's continuation differs only because of the intervention, and other requests run
exactly as recorded even when the fork changes how many draws the forked request takes; the fork's
meta `mode` says whether it is that exact re-execution from the recorded state or, where the parent
recorded no draws, a re-fed prefix (a speculative parent: re-execution from its recorded seeds). Stands above `trace/` because it
needs the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.rerun.rebuild import build_engine, parse_value, recorded_requests, run_recorded
from workbench.trace.diff import DiffReport, diff_traces
from workbench.trace.reader import Trace, open_trace


@dataclass(slots=True)
class BranchPoint:
    """Where a fork leaves its parent: request, output position, and what changes there."""

    req_id: str
    position: int
    token: int | None  # the forced token (None: only parameters change)
    token_text: str | None
    recorded_token: int
    recorded_text: str
    changes: dict[str, Any] = field(default_factory=dict)

    def to_meta(self, parent: str) -> dict[str, Any]:
        return {"parent": parent, "req_id": self.req_id, "position": self.position, "token": self.token,
                "token_text": self.token_text, "recorded_token": self.recorded_token,
                "recorded_text": self.recorded_text, "set": self.changes}


@dataclass(slots=True)
class ForkResult:
    path: str
    parent: str
    branch: BranchPoint
    report: DiffReport  # parent (A) vs fork (B)
    seconds: float
    mode: str = ""  # EXACT or REFED: how the fork shares its parent's state and random numbers

    def describe(self) -> str:
        from workbench.trace.diff_format import format_report

        how = {EXACT: "every request re-executed with the parent's recorded random draws, so the fork draws "
                      "what the parent drew at every position",
               EXACT_SEEDS: "speculative decoding draws per verify step, so the draws are not replayed per "
                            "position: common with the parent only while the steps run as recorded",
               REFED: "the parent's tokens re-fed before the branch point; draws after it from the request's "
                      "seed (common with the parent only for seeded requests)"}.get(self.mode, "")
        return (format_report(self.report) + f"\nfork: {self.mode}" + (f" ({how})" if how else "")
                + f"\nfork saved to {self.path} ({self.seconds:.1f} s)")


def parse_at(at: str) -> tuple[str, int]:
    rid, sep, pos = at.rpartition(":")
    if not sep or not rid or not pos.lstrip("-").isdigit():
        raise ValueError(f"--at must be REQ:POSITION (e.g. req-3:5), got {at!r}")
    return rid, int(pos)


def parse_changes(items: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(items, dict) or items is None:
        return dict(items or {})
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE (e.g. temperature=0)")
        out[key] = parse_value(raw)
    return out


def _check_changes(changes: dict[str, Any]) -> None:
    from workbench.engine.whatif import UPDATABLE

    bad = sorted(set(changes) - set(UPDATABLE))
    if bad:
        raise ValueError(f"--set: cannot change {', '.join(bad)} from a branch point; changeable: {', '.join(UPDATABLE)}")


def resolve_token(token: int | str | None, tokenizer: Any, recorded: Any) -> int | None:
    """`ID`, `rank:N` (the N-th of the recorded top-k at the branch point) or the TEXT of one token."""
    if token is None or isinstance(token, int):
        return token
    if token.startswith("rank:"):
        n = token[5:]
        top = recorded.top_logprobs
        if not n.isdigit() or not 1 <= int(n) <= len(top):
            raise ValueError(f"--token {token!r}: rank must be 1..{len(top)} (the recorded top-k there)")
        return int(top[int(n) - 1][0])
    if token.isdigit():
        return int(token)
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"--token {token!r} is {len(ids)} tokens {ids}; give the text of one token, an id or rank:N")
    return int(ids[0])


def _recorded_token(trace: Trace, req_id: str, position: int) -> Any:
    tokens = sorted(trace.events(kind="token", req_id=req_id), key=lambda e: e.position)
    if not tokens:
        known = [r.req_id for r in trace.requests()]
        raise ValueError(f"--at: request {req_id!r} has no recorded tokens; requests are {known}")
    if not 0 <= position < len(tokens):
        raise ValueError(f"--at {req_id}:{position}: position must be in [0, {len(tokens)}) (its recorded tokens)")
    return tokens[position]


def fork(trace: str, at: str | tuple[str, int], *, token: int | str | None = None,
         changes: list[str] | dict[str, Any] | None = None, out: str, device: str | None = None,
         progress: bool = False) -> ForkResult:
    """Re-execute `trace` up to `at` (REQ:POSITION), force `token` there and/or apply `changes`
    (sampling parameters) from there on; every other request runs as recorded. Writes `out`."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    rid, position = parse_at(at) if isinstance(at, str) else at
    changes = parse_changes(changes)
    _check_changes(changes)
    if token is None and not changes:
        raise ValueError("fork: give --token and/or --set, or the fork is the parent again")
    with open_trace(trace) as parent:
        recorded = _recorded_token(parent, rid, position)
        requests = recorded_requests(parent)
        cfg = dict(parent.meta.get("engine") or {})
        engine, sink = build_engine(parent, cfg, device, out, None)  # speculative as recorded, if it was
        num_steps = parent.num_steps
        parent_draws = recorded_draws(parent)
        parent_tokens = {r["req_id"]: _tokens(parent, r["req_id"]) for r in requests}
    forced = resolve_token(token, engine.tokenizer, recorded)
    branch = BranchPoint(rid, position, forced, engine.token_text(forced) if forced is not None else None,
                         recorded.token_id, recorded.text, changes)
    greedy = {r["req_id"] for r in requests if (r["params"] or {}).get("temperature", 1.0) == 0}
    mode, draws, prefix = _common_randoms(parent_draws, parent_tokens, greedy, rid, position, bool(cfg.get("spec")))
    engine.tracer.set_meta("fork", {**branch.to_meta(str(trace)), "mode": mode})
    if "seed" in changes and rid in draws:  # a new seed asks for new random numbers from the branch on
        draws = {**draws, rid: {p: u for p, u in draws[rid].items() if p < position}}
    state = {"forced": forced is None, "changed": not changes}
    given: set[str] = set()

    def at_branch(eng) -> None:
        for live in [r for r in eng.reqs if r not in given]:  # requests submitted this step
            given.add(live)
            if draws.get(live):
                eng.use_draws(live, draws[live])
            if live == rid:
                for p, tok in prefix.items():
                    eng.force_token(rid, p, tok)
        req = eng.reqs.get(rid)
        if req is None or req.finished:
            return
        if not state["forced"]:
            eng.force_token(rid, position, forced)
            state["forced"] = True
        if not state["changed"] and len(req.output_ids) == position:
            eng.update_params(rid, **changes)
            state["changed"] = True

    bar = tqdm(total=num_steps, disable=not progress, desc="forking", unit="step")
    try:
        for _ in run_recorded(engine, sink, requests, before_step=at_branch):
            bar.update(1)
    finally:
        bar.close()
        engine.close()
    with open_trace(trace) as a, open_trace(out) as b:
        report = diff_traces(a, b)
    return ForkResult(str(Path(out)), str(trace), branch, report, time.perf_counter() - t0, mode)


EXACT = "exact re-execution from the recorded state"
REFED = "re-fed prefix"
EXACT_SEEDS = "exact re-execution from the recorded seeds"


def _tokens(trace: Trace, req_id: str) -> list[Any]:
    return sorted(trace.events(kind="token", req_id=req_id), key=lambda e: e.position)


def recorded_draws(trace: Trace) -> dict[str, dict[int, float]]:
    """Each request's recorded uniform draw per output position (sampled positions; greedy ones have none)."""
    out: dict[str, dict[int, float]] = {}
    for e in trace.events(kind="sampling"):
        if e.req_id is not None and e.draw is not None:
            out.setdefault(e.req_id, {})[e.position] = float(e.draw)
    return out


def _common_randoms(draws: dict[str, dict[int, float]], tokens: dict[str, list[Any]], greedy: set[str], rid: str,
                    position: int, speculative: bool) -> tuple[str, dict[str, dict[int, float]], dict[int, int]]:
    """How the fork shares its parent's random numbers: (mode, draws to replay per request, tokens to
    force before the branch). Exact re-execution replays every recorded draw, so every request runs
    as recorded and the fork draws what the parent drew at every position; where a sampled position
    of the parent has no recorded draw (a trace without sampling records), the fork re-feeds the parent's tokens before the branch instead
    (its later draws come from the request's seed, if any). A speculative parent drew per verify
    step, not per position: the fork re-executes it from the recorded seeds."""
    complete = all(t.position in draws.get(r, {}) for r, toks in tokens.items() if r not in greedy
                   for t in toks if t.source == "sample")
    if speculative:  # verify steps draw per step, not per position: re-execute from the seeds as recorded
        return EXACT_SEEDS, {}, {}
    if complete:
        return EXACT, draws, {}
    return REFED, {}, {t.position: t.token_id for t in tokens.get(rid, []) if t.position < position}

