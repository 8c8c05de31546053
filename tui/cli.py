"""`workbench tui FILE | --live URL` (and `python -m tui`): its flags (`build_parser`), `main(argv)` and
the headless `--screenshot`. Opening the app is `tui.run`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tui import run


def build_parser(prog: str = "workbench tui") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Step through a workbench trace, or follow a running server's live events.",
        epilog="Press ? in the TUI for every key binding.")
    parser.add_argument("file", nargs="?", help="a .wbtrace file (it may still be being written)")
    parser.add_argument("--live", metavar="URL", help="follow a server's /debug/events stream, e.g. http://127.0.0.1:8000 "
                        "(a workbench watch proxy's URL opens its conformance view; w switches)")
    parser.add_argument("--tokenizer", metavar="PATH", help="a tokenizer folder or tokenizer.json to show prompt ids as text")
    parser.add_argument("--step", type=int, metavar="N", help="open at step N")
    parser.add_argument("--request", metavar="ID", help="select this request")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("WORKBENCH_API_KEY"),
                        help="the server's API key for --live (default: $WORKBENCH_API_KEY)")
    parser.add_argument("--screenshot", metavar="OUT.svg", help="save the screen as SVG (headless, 160x48) and exit")
    parser.add_argument("--size", metavar="COLSxROWS", default="160x48", help="--screenshot terminal size (default 160x48)")
    parser.add_argument("--web", metavar="[HOST:]PORT", help="serve this TUI in a browser (textual-serve), e.g. --web 8566")
    parser.add_argument("--no-times", action="store_true", help="hide timings (for reproducible screenshots)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "workbench tui") -> int:
    """The `workbench tui` command; returns 0 after a normal quit, 2 for bad arguments or an unreadable trace."""
    parser = build_parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if (args.file is None) == (args.live is None):
        parser.error("give a trace FILE or --live URL (exactly one)")
    try:
        if args.screenshot:
            return _screenshot(args)
        if args.web:
            from tui.web import serve

            return serve(list(sys.argv[1:] if argv is None else argv), args.web)
        return run(args.file, live=args.live, step=args.step, request=args.request, tokenizer=args.tokenizer,
                   api_key=args.api_key, show_times=not args.no_times)
    except ValueError as exc:  # TraceError is a ValueError
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _screenshot(args: argparse.Namespace) -> int:
    from tui.screenshot import screenshot
    from workbench.trace.reader import open_trace

    if args.file is None:
        raise ValueError("--screenshot needs a trace FILE")
    with open_trace(args.file) as source:
        cols, _, rows = args.size.partition("x")
        if not (cols.isdigit() and rows.isdigit()):
            raise ValueError(f"--size must be COLSxROWS, e.g. 80x24, got {args.size!r}")
        out = screenshot(source, args.screenshot, step=args.step, request=args.request, tokenizer=args.tokenizer,
                         show_times=not args.no_times, size=(int(cols), int(rows)))
    print(out)
    return 0
