"""The `workbench` subcommands that re-run or compare recorded runs: replay, diff, fork, invariance.

Owns: their parsers and the thin wiring to the library (workbench.replay, trace.diff,
workbench.against, workbench.branch, workbench.invariance), plus `_add`, the one way a subcommand
parser is made. Heavy imports happen inside each command, so `workbench --help` stays fast.
"""

from __future__ import annotations

import argparse


def _add(sub, name: str, help: str, **kw) -> argparse.ArgumentParser:
    """A subcommand parser: no prefix matching (`--max-new-token` is an error, not a guess)."""
    return sub.add_parser(name, help=help, description=help, allow_abbrev=False, **kw)


def cmd_replay(args: argparse.Namespace) -> int:
    from workbench.replay import main as replay_main

    return replay_main(args)


def cmd_diff(args: argparse.Namespace) -> int:
    from workbench.trace.diff import diff_traces, format_report
    from workbench.trace.reader import open_trace

    skipped: dict[str, str] = {}
    if args.against:
        if args.b is not None:
            raise ValueError("diff: give either B or --against PEER, not both")
        from workbench.against import record_peer

        peer = record_peer(args.a, args.against, args.against_out)
        args.b, skipped = peer.path, peer.skipped
    elif args.b is None:
        raise ValueError("diff: give a second trace B, or --against transformers")
    with open_trace(args.a) as a, open_trace(args.b) as b:
        report = diff_traces(a, b, tolerance=args.tolerance)
    if skipped:  # requests the peer cannot reproduce are not part of the comparison
        report.only_in_a = [r for r in report.only_in_a if r not in skipped]
    print(format_report(report))
    for rid, why in skipped.items():
        print(f"not compared: {rid} ({why})")
    if args.against:
        print(f"{args.against} trace: {args.b}")
    return 0 if report.identical else 1


def _add_diff_parser(sub) -> None:
    p = _add(sub, "diff", "line two traces up and report the first divergence, with a near-tie verdict")
    p.add_argument("a")
    p.add_argument("b", nargs="?", default=None)
    p.add_argument("--against", default=None, metavar="PEER",
                   help="record PEER's greedy run of A's prompts (transformers) and diff A against it")
    p.add_argument("--against-out", default=None, metavar="FILE.wbtrace", help="where to keep the peer's trace")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.set_defaults(func=cmd_diff)


def cmd_fork(args: argparse.Namespace) -> int:
    from workbench.branch import main as fork_main

    return fork_main(args)


def _add_fork_parser(sub) -> None:
    from workbench.branch import add_fork_args

    p = _add(sub, "fork", "re-run a trace up to REQ:POSITION, force a token or change parameters there")
    add_fork_args(p)
    p.set_defaults(func=cmd_fork)


def cmd_invariance(args: argparse.Namespace) -> int:
    from workbench.invariance import main as invariance_main

    return invariance_main(args)


def _add_invariance_parser(sub) -> None:
    from workbench.invariance import add_invariance_args

    p = _add(sub, "invariance", "re-run each recorded request alone and in its batch: logprob drift, "
                       "first differing token, near tie or not")
    add_invariance_args(p)
    p.set_defaults(func=cmd_invariance)


def _add_replay_parser(sub) -> None:
    from workbench.replay import add_replay_args

    p = _add(sub, "replay", "re-execute a trace and report the first divergence (--out saves the run)")
    add_replay_args(p)
    p.set_defaults(func=cmd_replay)


RUN_PARSERS = [_add_replay_parser, _add_diff_parser, _add_fork_parser, _add_invariance_parser]
