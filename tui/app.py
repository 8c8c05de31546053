"""The Textual app: one main screen over a trace file or a live server.

Owns `WorkbenchApp` (options in, the main screen out, styles from tui.tcss; a trace opened from the
conformance view is a main screen pushed over it). Everything else lives in screens/ and widgets/.
Does not import the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import App
from textual.screen import Screen

from tui.commands import WorkbenchCommands
from tui.screens.main import MainScreen
from tui.screens.workers import Options
from workbench.trace.live import TraceView


class WorkbenchApp(App[None]):
    """Step through a `.wbtrace` file, or follow a server (`live_url`)."""

    CSS_PATH = Path(__file__).with_name("tui.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "workbench"
    COMMANDS = App.COMMANDS | {WorkbenchCommands}  # ctrl+p: jump to a step, select a request, search, filter

    def __init__(self, path: str | None = None, *, source: TraceView | None = None, live_url: str | None = None,
                 tokenizer: str | None = None, api_key: str | None = None, show_times: bool = True,
                 step: int | None = None, request: str | None = None) -> None:
        if sum(x is not None for x in (path, source, live_url)) != 1:
            raise ValueError("WorkbenchApp needs exactly one of path, source or live_url")
        super().__init__()
        self.options = Options(path=path, source=source, live_url=live_url, tokenizer=tokenizer, api_key=api_key,
                               show_times=show_times, start_step=step, start_request=request)

    def get_default_screen(self) -> Screen:
        return MainScreen(self.options)

    def on_conformance_screen_open_request(self, message: Any) -> None:
        """`t` on the conformance view: the divergent request's trace file in the main view (`q` comes back)."""
        self.push_screen(MainScreen(Options(path=message.path, start_request=message.req_id,
                                            show_times=self.options.show_times)))

    @property
    def main(self) -> MainScreen:
        screen = self.screen_stack[0] if self.screen_stack else self.screen
        if not isinstance(screen, MainScreen):
            raise RuntimeError("the main screen is not mounted")
        return screen
