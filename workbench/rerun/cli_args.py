"""The commands that re-run or compare recorded runs: `replay`, `diff`, `fork`, `invariance`, `bisect`.

Owns: each command's flags (`add_*_args(parser)`) and running it (`run_*(args)`, an exit status),
the thin wiring to the library (rerun.replay, trace.diff, external.against, rerun.fork,
rerun.invariance, rerun.bisect, rerun.behaves_like). Importing this module imports no engine: heavy imports happen inside each `run_*`,
so `workbench --help` stays fast. Does not own: the top-level parser or dispatch (workbench/cli/).
"""

from __future__ import annotations

import argparse
import sys

from workbench.rerun.replay import COMPARE  # light: the engine loads only when a replay runs


def add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--override", action="append", default=[], metavar="REQ:FIELD=VALUE",
                   help="change a recorded request's sampling parameter, or engine.FIELD=VALUE")
    p.add_argument("--compare", choices=COMPARE, default="steps",
                   help="what must match: every step's events (default), each request's tokens, or final outputs")
    p.add_argument("--out", default=None, metavar="R.wbtrace", help="save the replayed run as a trace")
    p.add_argument("--device", default=None)


def run_replay(args: argparse.Namespace) -> int:
    from workbench.rerun.replay import replay

    report = replay(args.trace, overrides=args.override, tolerance=args.tolerance, device=args.device,
                    progress=sys.stderr.isatty(), compare=args.compare, out=args.out)
    print(report.describe())
    return 0 if report.identical else 1


def add_diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a")
    p.add_argument("b", nargs="?", default=None)
    p.add_argument("--against", default=None, metavar="PEER",
                   help="record PEER's greedy run of A's prompts (transformers) and diff A against it")
    p.add_argument("--against-out", default=None, metavar="FILE.wbtrace", help="where to keep the peer's trace")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--floor", default=None, metavar="FLOOR.json",
                   help="a noise floor from `workbench floor`: a flip within the engine's own spread is "
                        "'inside the floor', and each request counts its positions beyond it")


def run_diff(args: argparse.Namespace) -> int:
    from workbench.trace.diff import diff_traces
    from workbench.trace.diff_format import format_report
    from workbench.trace.reader import open_trace

    skipped: dict[str, str] = {}
    if args.against:
        if args.b is not None:
            raise ValueError("diff: give either B or --against PEER, not both")
        from workbench.external.against import record_peer

        peer = record_peer(args.a, args.against, args.against_out)
        args.b, skipped = peer.path, peer.skipped
    elif args.b is None:
        raise ValueError("diff: give a second trace B, or --against transformers")
    floor = None
    if args.floor:
        from workbench.external.floor import load_floor

        floor = load_floor(args.floor)
    with open_trace(args.a) as a, open_trace(args.b) as b:
        report = diff_traces(a, b, tolerance=args.tolerance, floor=floor)
    if skipped:  # requests the peer cannot reproduce are not part of the comparison
        report.only_in_a = [r for r in report.only_in_a if r not in skipped]
    print(format_report(report))
    for rid, why in skipped.items():
        print(f"not compared: {rid} ({why})")
    if args.against:
        print(f"{args.against} trace: {args.b}")
    return 0 if report.identical else 1


def add_fork_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace")
    p.add_argument("--at", required=True, metavar="REQ:POSITION", help="the branch point, e.g. req-3:5")
    p.add_argument("--token", default=None, metavar="ID|TEXT|rank:N",
                   help="force this token at the branch point (rank:2 is the recorded runner-up)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change the request's sampling parameters from the branch point on (temperature=0 ...)")
    p.add_argument("--out", required=True, metavar="F.wbtrace")
    p.add_argument("--device", default=None)


def run_fork(args: argparse.Namespace) -> int:
    from workbench.rerun.fork import fork

    result = fork(args.trace, args.at, token=args.token, changes=args.set, out=args.out, device=args.device,
                  progress=sys.stderr.isatty())
    print(result.describe())
    return 0


def add_invariance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace")
    p.add_argument("--request", action="append", default=[], metavar="REQ",
                   help="only this request (repeatable); also prints its per-position table")
    p.add_argument("--tolerance", type=float, default=1e-3, help="top-2 margin below which a flip is a near tie")
    p.add_argument("--context", action="append", default=[], metavar="CONTEXT",
                   help="another context to compare the recorded batch with, besides alone (repeatable): chunked:N "
                        "(chunked prefill of N tokens), prefix-cache (the prompt a prefix-cache hit), speculative "
                        "(n-gram speculative decoding toggled); each a column of the flip-risk map")
    p.add_argument("--device", default=None)
    p.add_argument("--no-store", action="store_true",
                   help="do not store the result in the trace (by default the TUI shows it for each request)")


def run_invariance(args: argparse.Namespace) -> int:
    from workbench.rerun.invariance import invariance

    report = invariance(args.trace, device=args.device, tolerance=args.tolerance, progress=sys.stderr.isatty(),
                        req_ids=args.request or None, contexts=args.context)
    print(report.describe())
    print("\n" + report.risk_table())
    for rid in args.request or []:
        print(f"\n{rid}, per position:\n{report.positions_table(rid)}")
    if not args.no_store:
        from workbench.trace.invariance_store import store_invariance

        store_invariance(args.trace, report.summary(), report.rows())
        print(f"stored in {args.trace} (workbench tui {args.trace} shows it in the Tokens pane)", file=sys.stderr)
    return 0


def _suspect(value: str) -> str:
    """--against: a numerics, a batch context, or auto (argparse's message for anything else)."""
    from workbench.rerun.contexts import is_context, parse_context
    from workbench.trace.bisect_store import CANDIDATES

    if value in (*CANDIDATES, "auto"):
        return value
    if is_context(value):
        try:
            return parse_context(value).name
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(CANDIDATES)}, batched, "
                                     "prefix-cache, chunked:N, auto)")


def _candidates(value: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    for name in names:
        if name == "auto":
            raise argparse.ArgumentTypeError("--candidates: auto is not a candidate")
        _suspect(name)
    if not names:
        raise argparse.ArgumentTypeError("--candidates: give at least one name")
    return names


def add_bisect_args(p: argparse.ArgumentParser) -> None:
    from workbench.trace.bisect_store import CANDIDATES

    p.add_argument("trace")
    p.add_argument("--at", required=True, metavar="REQ:POSITION", help="the position to explain, e.g. req-3:5")
    p.add_argument("--against", default=None, metavar="SUSPECT", type=_suspect,
                   help=f"the numerics under suspicion: {', '.join(CANDIDATES[1:])}; a batch context: batched "
                        "(with the trace's other requests), prefix-cache, chunked:N (chunked prefill of N tokens); or "
                        "auto (which of those the trace's engine behaves like, then bisect that one); default: auto "
                        "for a probed trace, bfloat16 otherwise")
    p.add_argument("--candidates", default=None, type=_candidates, metavar="A,B,...",
                   help="auto: the candidates to fit (default: every numerics, and every context that applies: "
                        "alone, batched, prefix-cache, chunked:N for N in 8, 16, ... below the prompt's length)")
    p.add_argument("--model", default=None, help="the reference model (default: the trace's; smollm2 for a probe)")
    p.add_argument("--factor", type=float, default=1.0, help="name a block whose added error is above FACTOR x its floor")
    p.add_argument("--window", type=int, default=4, help="auto: neighbours each side of the position to compare")
    p.add_argument("--device", default=None)
    p.add_argument("--no-store", action="store_true", help="do not store the result in the trace")


def run_bisect(args: argparse.Namespace) -> int:
    from workbench.rerun.bisect import bisect, reference_runner
    from workbench.trace.reader import open_trace

    with open_trace(args.trace) as t:
        external = t.meta.get("source") == "external"
        runner, load = reference_runner(t, args.model, args.device)
    against = args.against or ("auto" if external else "bfloat16")
    if against == "auto":
        from workbench.rerun.behaves_like import behaves_like

        fit = behaves_like(args.trace, args.at, window=args.window, runner=runner, load=load,
                           store=not args.no_store, candidates=args.candidates)
        print(fit.describe())
        if fit.best in ("float32", "alone"):
            print("the engine behaves like the reference numerics here: nothing to bisect")
            return 0
        against = fit.best
    result = bisect(args.trace, args.at, against=against, factor=args.factor, runner=runner, load=load,
                    store=not args.no_store)
    print(result.describe())
    if not args.no_store:
        print(f"stored in {args.trace} (workbench.trace.bisect_store.read_bisects)", file=sys.stderr)
    return 0
