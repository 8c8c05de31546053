"""The pane base class and the context every pane draws from.

Owns: `PaneContext` (the loaded step, the selected request's output, the selection, the vocabulary
and display options) and `Pane` (a scrolling, focusable box whose body is redrawn from a context;
`text()` gives what it shows as plain text, for tests and for copying). Does not own any pane's
content: each subclass implements `draw`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from rich.console import Console, RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.nav import Selection
from tui.search import SearchHit
from tui.stepview import ReqStep, RequestData, StepView
from tui.vocab import Vocab


@dataclass(frozen=True, slots=True)
class PaneContext:
    """Everything a pane may show; built on the UI thread from what the workers loaded."""

    view: StepView | None
    request: RequestData | None
    selection: Selection
    vocab: Vocab
    show_times: bool = True
    hit: SearchHit | None = None

    @property
    def req_step(self) -> ReqStep | None:
        return self.view.req(self.selection.req_id) if self.view is not None else None


class Pane(VerticalScroll, can_focus=True):
    """A bordered, scrolling pane; subclasses set TITLE and implement `draw`."""

    TITLE = "pane"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self._renderable: RenderableType = Text("")
        self.border_title = self.TITLE

    def compose(self) -> ComposeResult:
        yield Static(self._renderable, classes="pane-body")

    def draw(self, ctx: PaneContext) -> RenderableType:
        raise NotImplementedError

    def subtitle(self, ctx: PaneContext) -> str:
        return ""

    def show(self, ctx: PaneContext) -> None:
        """Redraw from `ctx` (UI thread only)."""
        self._renderable = self.draw(ctx)
        self.border_subtitle = self.subtitle(ctx)
        if self.is_mounted:
            self.query_one(".pane-body", Static).update(self._renderable)

    def text(self, width: int | None = None) -> str:
        """What the pane shows, as plain text at its current width (or `width`)."""
        width = width or max(self.scrollable_content_region.width, 40)
        console = Console(file=io.StringIO(), width=width, color_system=None, record=True,
                          legacy_windows=False, force_terminal=False)
        console.print(self._renderable)
        return console.export_text()
