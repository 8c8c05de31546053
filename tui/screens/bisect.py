"""The bisect overlay (`b` on a token of a request with a stored `workbench bisect` result).

Owns the overlay: one stored result at a time (the selected token's position when it has one,
else the request's first), `n`/`p` (and the arrows) to the next or previous stored position,
escape / q / b to close. The rows come from the screen that opens it (tui/model.py reads them);
drawing is tui/widgets/bisect.py.
"""

from __future__ import annotations

import io

from rich.console import Console
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tui.widgets.bisect import bisect_view


class BisectScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,b", "dismiss", "Close"),
                Binding("n,right,l,j", "move(1)", "Next stored position"),
                Binding("p,left,h,k", "move(-1)", "Previous stored position")]

    def __init__(self, req_id: str, results: list[tuple[int, dict | None, dict | None]], position: int | None) -> None:
        super().__init__()
        self.req_id = req_id
        self.results = results
        positions = [p for p, _, _ in results]
        self.index = positions.index(position) if position in positions else 0

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="bisect-box") as box:
            box.border_title = f"Bisect · {self.req_id}"
            yield Static(id="bisect-body")

    def on_mount(self) -> None:
        self.draw()

    def draw(self) -> None:
        position, row, fit = self.results[self.index]
        self.query_one("#bisect-box").border_subtitle = f"position {position}"
        self.query_one("#bisect-body", Static).update(bisect_view(position, row, fit, self.index, len(self.results)))

    def text(self) -> str:
        """The overlay's text as a user reads it (plain)."""
        position, row, fit = self.results[self.index]
        console = Console(file=io.StringIO(), width=150, color_system=None, record=True, force_terminal=False)
        console.print(bisect_view(position, row, fit, self.index, len(self.results)))
        return console.export_text()

    def action_move(self, delta: int) -> None:
        self.index = (self.index + delta) % len(self.results)
        self.draw()

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
