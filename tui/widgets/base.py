"""The pane base class and the context every pane draws from.

Owns: `PaneContext` (the loaded step, the selected request's output, the selection, the vocabulary
and display options) and `Pane`: a bordered, focusable Line-API scroll view. A pane renders its
content to lines once per update, at its own width (or the content's natural width for tables,
scrolled sideways), and then only copies the lines on screen; no page-wide layout pass happens
when a step changes. `text()` gives what it shows as plain text, for tests and for copying. Does
not own any pane's content: each subclass implements `draw`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.segment import Segment
from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.nav import Selection
from tui.search import SearchHit
from tui.stepview import ReqStep, RequestData, StepView
from tui.vocab import Vocab

MAX_WIDE = 240  # widest a table is drawn before it squeezes (then scroll sideways to read it)


@dataclass(frozen=True, slots=True)
class PaneContext:
    """Everything a pane may show; built on the UI thread from what the workers loaded."""

    view: StepView | None
    request: RequestData | None
    selection: Selection
    vocab: Vocab
    show_times: bool = True
    hit: SearchHit | None = None
    not_recorded: frozenset[str] = frozenset()  # event kinds the trace's source does not report

    @property
    def req_step(self) -> ReqStep | None:
        return self.view.req(self.selection.req_id) if self.view is not None else None


class Pane(ScrollView, can_focus=True):
    """A bordered, scrolling pane; subclasses set TITLE (and WIDE for tables) and implement `draw`."""

    TITLE = "pane"
    WIDE = False  # True: draw at the content's natural width, not wrapped to the pane
    MIN_WIDTH = 20  # never wrap narrower than this (a narrow pane scrolls sideways instead)
    RECORDS: tuple[str, ...] = ()  # the event kinds this pane draws; none of them recorded -> "not recorded"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self._renderable: RenderableType = Text("")
        self._strips: list[Strip] = []
        self._drawn_width = 0
        self.border_title = self.TITLE

    def draw(self, ctx: PaneContext) -> RenderableType:
        raise NotImplementedError

    def subtitle(self, ctx: PaneContext) -> str:
        return ""

    def not_recorded_text(self) -> Text:
        """What a pane shows when the trace's source does not report what it draws (never zeros)."""
        return Text(f"{self.TITLE}: not recorded. An external engine reports only its stream: tokens, "
                    "logprobs, top-k, finish reason, usage and chunk times.", style="dim italic")

    def show(self, ctx: PaneContext) -> None:
        """Redraw from `ctx` (UI thread only)."""
        missing = bool(self.RECORDS) and set(self.RECORDS) <= ctx.not_recorded
        self._renderable = self.not_recorded_text() if missing else self.draw(ctx)
        self.border_subtitle = self.subtitle(ctx)
        self._render_strips()

    def _render_strips(self) -> None:
        if not self.is_mounted:
            return
        width = max(self.scrollable_content_region.width, self.MIN_WIDTH)
        console = self.app.console
        options = console.options.update(width=width, height=None, highlight=False)
        if self.WIDE:
            natural = Measurement.get(console, options.update_width(MAX_WIDE), self._renderable).maximum
            options = options.update_width(max(width, min(natural, MAX_WIDE)))
        lines = console.render_lines(self._renderable, options, style=self.rich_style, pad=False)
        old_height = len(self._strips)
        self._strips = [Strip(Segment.simplify(line)) for line in lines]
        while self._strips and not self._strips[-1].text.strip():
            self._strips.pop()  # Rich ends a Group with a blank line
        self._drawn_width = self.scrollable_content_region.width
        self.virtual_size = Size(max((s.cell_length for s in self._strips), default=0), len(self._strips))
        self.refresh(layout=old_height != len(self._strips) and self.styles.height.is_auto)

    def on_resize(self) -> None:
        if self.scrollable_content_region.width != self._drawn_width:
            self._render_strips()

    def on_mount(self) -> None:
        self._render_strips()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        row = scroll_y + y
        if row >= len(self._strips):
            return Strip.blank(width, self.rich_style)
        return self._strips[row].crop_extend(scroll_x, scroll_x + width, self.rich_style)

    def text(self, width: int | None = None) -> str:
        """What the pane shows, as plain text at its current width (or `width`)."""
        width = width or max(self.scrollable_content_region.width, 40)
        console = Console(file=io.StringIO(), width=width, color_system=None, record=True,
                          legacy_windows=False, force_terminal=False)
        console.print(self._renderable)
        return console.export_text()
