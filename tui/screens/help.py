"""The help overlay (`?`): every key binding of the main screen, generated from its BINDINGS.

Owns the overlay. It reads the bindings it is given, so a binding added to the screen appears
here without editing this file.
"""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEY_DISPLAY = {"slash": "/", "colon": ":", "question_mark": "?", "left_square_bracket": "[",
               "right_square_bracket": "]", "escape": "esc"}


def display_key(key: str) -> str:
    """A binding's key as the user types it (`slash` -> `/`)."""
    return KEY_DISPLAY.get(key, key)


EXTRA = [("tab / shift+tab", "Move focus between panes (arrows then scroll the focused pane)"),
         ("↑ (command line)", "Recall the last search, filter or jump"),
         ("mouse", "Click a step; the wheel scrolls the pane under the pointer")]


def help_table(bindings: list[Binding]) -> Table:
    """Keys grouped by action, in the order the screen declares them."""
    grouped: dict[str, tuple[list[str], str]] = {}
    for b in bindings:
        keys, desc = grouped.setdefault(b.action, ([], b.description or b.action))
        keys.extend(display_key(k.strip()) for k in b.key.split(","))
    table = Table(box=None, pad_edge=False, padding=(0, 2), header_style="bold")
    table.add_column("keys", style="bold cyan", no_wrap=True)
    table.add_column("does")
    for keys, desc in grouped.values():
        table.add_row(" ".join(keys), desc)
    for keys, desc in EXTRA:
        table.add_row(keys, desc)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close help")]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.table = help_table(bindings)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "Keys (escape closes)"
            yield Static(self.table, id="help-body")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
