"""The command line at the bottom: one input for search (`/`), filter (`f`) and jump to step (`:`).

Owns: showing the input with its prompt, remembering each mode's last value, and posting
`CommandLine.Done(mode, value)` on Enter (Escape closes it with nothing; ↑ recalls the mode's last
value), and replaying keys typed before it took focus (`type_ahead`). Does not own what a command
does (the screen does).
"""

from __future__ import annotations

from textual import events, on
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

PROMPTS = {"search": "/", "filter": "filter: ", "jump": "step: "}
PLACEHOLDERS = {
    "search": "text in the output, or #id for a token id (Enter; ]/[ for next/previous)",
    "filter": "request id or prompt text; empty clears the filter",
    "jump": "step number",
}

TYPE_AHEAD_ACTIONS = {"enter": "submit", "escape": "close", "backspace": "delete_left"}


class CommandLine(Input):
    BINDINGS = [Binding("escape", "close", "Close", show=False),
                Binding("up", "recall", "Previous value", show=False)]

    class Done(Message):
        def __init__(self, mode: str, value: str) -> None:
            super().__init__()
            self.mode, self.value = mode, value

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        # No select-on-focus: the focus event lands after keys typed right behind `/` and would select them.
        super().__init__(id=id, select_on_focus=False)
        self.mode = "search"
        self.history: dict[str, str] = {}
        self._seen: events.Key | None = None

    def open(self, mode: str) -> None:
        if mode not in PROMPTS:
            raise ValueError(f"command line mode must be one of {sorted(PROMPTS)}, got {mode!r}")
        self.mode = mode
        self.border_title = PROMPTS[mode]
        last = self.history.get(mode)
        self.placeholder = PLACEHOLDERS[mode] + (f"; ↑ recalls {last!r}" if last else "")
        self.value = ""
        self.add_class("open")
        # Focus now, not after a refresh (Widget.focus defers): keys typed right after `/` land here.
        self.screen.set_focus(self)

    def on_key(self, event: events.Key) -> None:
        self._seen = event  # the screen must not replay a key the line already has

    def saw(self, event: events.Key) -> bool:
        return self._seen is event

    def type_ahead(self, event: events.Key) -> None:
        """Apply a key that was queued for another widget before the line took focus."""
        if event.is_printable and event.character:
            self.call_later(self.insert_text_at_cursor, event.character)
        elif event.key in TYPE_AHEAD_ACTIONS:
            self.call_later(self.run_action, TYPE_AHEAD_ACTIONS[event.key])

    def action_recall(self) -> None:
        self.value = self.history.get(self.mode, self.value)
        self.cursor_position = len(self.value)

    def action_close(self) -> None:
        self.remove_class("open")
        self.screen.focus_next()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.history[self.mode] = event.value
        self.remove_class("open")
        self.post_message(self.Done(self.mode, event.value.strip()))
