"""The text report of a trace diff (`workbench diff A B`): the first divergence with its verdict and
both sides' top-k, a parent/fork summary (shared prefix, branch point, both continuations), and a
table per request. Owns wording only; the comparison is trace/diff.py's.
"""

from __future__ import annotations

from typing import Any

from workbench.trace.diff import DiffReport, PositionDiff, RequestDiff


def fmt_top(top: list[Any], n: int = 5) -> str:
    """`'text':logprob, ...` of a recorded top-k list ([[id, logprob, text], ...])."""
    if not top:
        return "(none recorded)"
    return ", ".join(f"{t[2]!r}:{t[1]:.3f}" if len(t) > 2 and t[1] is not None else f"{t[0]}:{t[1]}" for t in top[:n])


def describe_divergence(first: PositionDiff) -> list[str]:
    lines = [f"first divergence: request {first.req_id}, position {first.position} "
             f"(step {first.step_a} in A, {first.step_b} in B): {first.text_a!r} ({first.token_a}) vs "
             f"{first.text_b!r} ({first.token_b})",
             f"  A top-k: {fmt_top(first.top_a)}", f"  B top-k: {fmt_top(first.top_b)}"]
    if first.verdict is not None:
        lines.append(f"  verdict: {first.verdict.describe()}")
    if first.kl is None:
        lines.append("  KL: not defined here (a side has no top-k distribution)")
    return lines


def _fork_lines(report: DiffReport) -> list[str]:
    fork = report.fork or {}
    rid, pos = fork.get("req_id"), fork.get("position")
    try:
        r = report.request(rid)
    except KeyError:
        return [f"fork of {fork.get('parent')!r} at {rid}:{pos}, but no such request here"]
    what = [f"forced token {fork['token_text']!r} ({fork['token']})"] if fork.get("token") is not None else []
    what += [f"set {k}={v}" for k, v in (fork.get("set") or {}).items()]
    others = [x for x in report.requests if x.req_id != rid]
    same = sum(1 for x in others if x.first_divergence is None and x.len_a == x.len_b)
    return [f"fork of {fork.get('parent')!r} at {rid}:{pos} ({', '.join(what) or 'no change'})",
            f"  shared prefix: {r.shared_prefix} tokens of {rid}; other requests identical: {same}/{len(others)}",
            f"  A continues: {r.continuation_a!r}", f"  B continues: {r.continuation_b!r}"] + (
        ["  (the fork ran without speculative decoding, which the parent used)"] if fork.get("spec_disabled") else [])


def kernels_note(a: str | None, b: str | None, names: tuple[str, str] = ("A", "B")) -> list[str]:
    """A line saying that a side ran a fast (non-exact) numerics mode, so no comparison reads as exact."""
    fast = [(n, k) for n, k in zip(names, (a, b)) if k not in (None, "exact")]
    if not fast:
        return []
    who = " and ".join(f"{n} ran kernels={k!r}" for n, k in fast)
    if len(fast) == 2 and a == b:
        return [f"numerics: {who}: both sides use the same non-exact kernels, so agreement here is agreement "
                "with itself, not with transformers' numbers"]
    return [f"numerics: {who} (not transformers' numbers: bf16/int8 GEMMs, fused ops); differences from an exact "
            "run are expected and are not a bug of the engine"]


def _row(r: RequestDiff, floor: bool) -> str:
    kl = "n/a" if r.mean_kl is None else f"{r.mean_kl:.2e}"
    first = r.first_divergence
    where = (f"{first.position} {first.verdict.short if first.verdict else 'unknown'}" if first is not None
             else "length" if r.len_a != r.len_b else "—")
    return (f"{r.req_id:<16} {r.compared:>8} {r.len_a:>6} {r.len_b:>6} {r.max_logprob_delta:>9.2e} "
            f"{kl:>9} {r.topk_changes:>9}" + (f" {r.beyond_floor:>7}" if floor else "") + f"  {where}")


def floor_lines(report: DiffReport) -> list[str]:
    """The floor the positions were classified against: measured, or the constant tolerance."""
    f = report.floor
    if f is None:
        return [f"floor: none measured; a flip is a near tie when the top-2 margin is under {report.tolerance:g} "
                "nats (workbench floor measures the engine's own spread; give it with --floor FILE)"]
    src = f.get("source") or {}
    beyond = sum(r.beyond_floor for r in report.requests)
    compared = sum(r.compared for r in report.requests)
    return [f"floor: measured at {src.get('url') or '?'} ({f.get('positions')} positions): the engine's own "
            f"|Δlogprob| up to {f.get('max_abs', 0):.3g} nats, own flips at margins up to "
            f"{f.get('max_flip_margin', 0):.3g}; {beyond} of {compared} compared positions beyond it"]


def differing_lines(report: DiffReport) -> list[str]:
    """One line per request whose tokens (or length) differ: where, both tokens, and the verdict."""
    diff = report.differing
    lines = [f"requests that differ: {len(diff)} of {len(report.requests)}"]
    for r in diff:
        name = r.req_id if r.req_id == r.req_id_b else f"{r.req_id} (B: {r.req_id_b})"
        p = r.first_divergence
        if p is None:
            lines.append(f"  {name}: same tokens for {r.compared}, then A has {r.len_a} and B {r.len_b}")
            continue
        lines.append(f"  {name} position {p.position}: {p.text_a!r} ({p.token_a}) vs {p.text_b!r} ({p.token_b}), "
                     + (p.verdict.describe() if p.verdict else "no verdict"))
    return lines


def format_report(report: DiffReport) -> str:
    lines = kernels_note(*report.kernels)
    if report.fork:
        lines += _fork_lines(report)
    first = report.first_divergence
    if first is None:
        lines.append("no token differs" + ("" if report.identical else " (but the runs differ in length or requests)"))
    else:
        lines += describe_divergence(first)
    floor = report.floor is not None
    lines += floor_lines(report)
    lines.append(f"{'request':<16} {'compared':>8} {'len A':>6} {'len B':>6} {'max|dlp|':>9} {'mean KL':>9} "
                 f"{'top-k chg':>9}" + (f" {'>floor':>7}" if floor else "") + "  first diff")
    lines += [_row(r, floor) for r in report.requests]
    if report.differing:
        lines += differing_lines(report)
    undefined = sorted({r.kl_undefined for r in report.requests if r.kl_undefined})
    for why in undefined:
        lines.append(f"KL not defined where {why}")
    lines += [f"only in A: {rid}" for rid in report.only_in_a]
    lines += [f"only in B: {rid}" for rid in report.only_in_b]
    return "\n".join(lines)
