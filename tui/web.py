"""`workbench tui FILE --web [HOST:]PORT`: the same TUI in a browser, served by textual-serve.

Owns: turning the command line back into the TUI command without `--web` and serving it with
`textual_serve.server.Server` (the library behind `textual serve`): each browser tab that opens the
page starts its own TUI process and talks to it over a websocket. Loopback by default, as the
server is. Does not own the app.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence


def parse_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--web must be PORT or HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def tui_command(argv: Sequence[str]) -> str:
    """The TUI command line without `--web ADDRESS` (run per browser tab)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--web":
            skip = True
        elif not arg.startswith("--web="):
            out.append(arg)
    return shlex.join([sys.executable, "-m", "tui", *out])


def serve(argv: Sequence[str], address: str) -> int:
    try:
        from textual_serve.server import Server
    except ImportError:
        raise ValueError("--web needs textual-serve: pip install textual-serve") from None
    host, port = parse_address(address)
    print(f"serving the TUI at http://{host}:{port} (ctrl+c stops)", file=sys.stderr, flush=True)
    Server(tui_command(argv), host=host, port=port, title="workbench").serve()
    return 0
