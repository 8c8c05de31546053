"""The workbench TUI: step through a `.wbtrace` trace, or follow a running server's live events.

Public API: `run(path)` / `run(live=URL)` opens the TUI on a trace file or a server and returns 0
when the user quits (what `workbench demo` calls); `main(argv)` is the command line (tui/cli.py:
`workbench tui FILE | --live URL`, `python -m tui ...`) and returns an exit status. Importing this package imports nothing heavy:
Textual loads when the app starts. The TUI reads traces through `workbench.trace` only.
"""

from __future__ import annotations

import os

__all__ = ["main", "run"]


def run(path: str | None = None, *, live: str | None = None, step: int | None = None, request: str | None = None,
        tokenizer: str | None = None, api_key: str | None = None, show_times: bool = True) -> int:
    """Open the TUI on a trace file, or follow a server with `live=URL`; blocks until the user quits.

    Returns 0. Raises ValueError (TraceError for an unreadable trace, or a bad URL) before the
    screen is taken over, so callers can print the message.
    """
    from tui.app import WorkbenchApp
    from tui.live import events_url
    from workbench.trace.reader import open_trace

    if (path is None) == (live is None):
        raise ValueError("tui: give a trace FILE or --live URL (exactly one)")
    if tokenizer is not None and not os.path.exists(tokenizer):
        raise ValueError(f"--tokenizer: no such file or folder: {tokenizer!r}")
    source = open_trace(path) if path is not None else None
    url = events_url(live) if live is not None else None
    try:
        WorkbenchApp(source=source, live_url=url, step=step, request=request, tokenizer=tokenizer,
                     api_key=api_key, show_times=show_times).run()
    finally:
        if source is not None:
            source.close()
    return 0



def main(argv=None, prog: str = "workbench tui") -> int:
    """The `workbench tui` command (tui/cli.py)."""
    from tui.cli import main as cli_main

    return cli_main(argv, prog)
