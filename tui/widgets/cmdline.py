"""The command line at the bottom: one input for search (`/`), filter (`f`) and jump to step (`:`).

Owns: showing the input with its prompt, remembering each mode's last value, and posting
`CommandLine.Done(mode, value)` on Enter (Escape closes it with nothing). Does not own what a
command does (the screen does).
"""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

PROMPTS = {"search": "/", "filter": "filter: ", "jump": "step: "}
PLACEHOLDERS = {
    "search": "text in the output, or #id for a token id (Enter; ]/[ for next/previous)",
    "filter": "request id or prompt text; empty clears the filter",
    "jump": "step number",
}


class CommandLine(Input):
    BINDINGS = [Binding("escape", "close", "Close", show=False)]

    class Done(Message):
        def __init__(self, mode: str, value: str) -> None:
            super().__init__()
            self.mode, self.value = mode, value

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.mode = "search"
        self.history: dict[str, str] = {}

    def open(self, mode: str) -> None:
        if mode not in PROMPTS:
            raise ValueError(f"command line mode must be one of {sorted(PROMPTS)}, got {mode!r}")
        self.mode = mode
        self.border_title = PROMPTS[mode]
        self.placeholder = PLACEHOLDERS[mode]
        self.value = self.history.get(mode, "")
        self.add_class("open")
        self.focus()

    def action_close(self) -> None:
        self.remove_class("open")
        self.screen.focus_next()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.history[self.mode] = event.value
        self.remove_class("open")
        self.post_message(self.Done(self.mode, event.value.strip()))
