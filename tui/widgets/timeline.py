"""The step timeline: one row per visible step (mode, batch size, tokens, time), drawn lazily.

Owns: `StepTimeline`, a Line-API scroll view that formats only the rows on screen (a trace with
thousands of steps costs nothing to show), the cursor row, and `row_text` / `HEADER` (the row
format). Clicking a row posts `StepTimeline.Picked`. Does not own which steps are visible or which
is selected (the screen's Navigator decides; this widget draws what it is told).
"""

from __future__ import annotations

from rich.segment import Segment
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.fmt import ms
from tui.nav import Navigator
from workbench.trace.format import shown_mode
from workbench.trace.reader import StepInfo

HEADER = f"{'step':>6} {'mode':<7} {'bs':>3} {'tok':>5} {'out':>4} {'ms':>7} {'spec':>5}"
_MODES = {"TARGET_VERIFY": "VERIFY", "DRAFT_EXTEND": "DRAFT"}


def row_text(info: StepInfo, show_times: bool = True, not_recorded: frozenset[str] = frozenset()) -> str:
    """One timeline row: step, mode, batch size, tokens in the forward, tokens out, ms, accepted/drafted.

    A trace whose source reports no forwards (an external engine: a step is one received chunk) shows
    `chunk` and `—` for what it did not report, never zeros."""
    if "forward" in not_recorded and info.mode is None:
        return f"{info.step:>6} {'chunk':<7} {'—':>3} {'—':>5} {info.output_tokens:>4} {'—':>7} {'':>5}"
    mode = shown_mode(info.mode, info.spec_proposed) or "IDLE"
    mode = _MODES.get(mode, mode)[:7]
    spec = f"{info.spec_accepted}/{info.spec_proposed}" if info.spec_proposed else ""
    return (f"{info.step:>6} {mode:<7} {info.batch_size:>3} {info.num_tokens:>5} {info.output_tokens:>4} "
            f"{ms(info.forward_ms, show_times):>7} {spec:>5}")


class StepTimeline(ScrollView, can_focus=True):
    """The visible steps, one per line, with the selected one highlighted."""

    COMPONENT_CLASSES = {"timeline--cursor", "timeline--row", "timeline--header"}
    # Keys that would scroll a plain scroll view move the selection instead (the screen's actions).
    BINDINGS = [
        Binding("down", "screen.next_step", show=False),
        Binding("up", "screen.prev_step", show=False),
        Binding("pagedown", "screen.page(10)", show=False),
        Binding("pageup", "screen.page(-10)", show=False),
        Binding("home", "screen.first_step", show=False),
        Binding("end", "screen.last_step", show=False),
        Binding("right", "screen.token(1)", show=False),
        Binding("left", "screen.token(-1)", show=False),
    ]

    class Picked(Message):
        """The user clicked a step."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.nav = Navigator()
        self.cursor: int | None = None
        self.show_times = True
        self.not_recorded: frozenset[str] = frozenset()  # the trace source's unreported kinds
        self.border_title = "Steps"

    def set_rows(self, nav: Navigator, show_times: bool = True) -> None:
        """Use `nav.visible` as the rows (UI thread)."""
        self.nav, self.show_times = nav, show_times
        self.virtual_size = Size(len(HEADER) + 1, len(nav) + 1)  # + the header line
        self.border_subtitle = f"{len(nav)} of {len(nav.steps)}" if nav.filter_ids is not None else f"{len(nav)}"
        self.refresh()

    def set_cursor(self, step: int | None) -> None:
        """Highlight `step` and scroll it into view."""
        self.cursor = step
        row = self.nav.index(step)
        if row is not None:
            top, height = round(self.scroll_offset.y), self.scrollable_content_region.height - 1
            if row < top or row >= top + height:
                self.scroll_to(y=max(row - height // 2, 0), animate=False, immediate=True)
        self.refresh()

    def visible_rows(self) -> list[str]:
        """The rows on screen now, as text (what the user sees)."""
        top, height = round(self.scroll_offset.y), self.scrollable_content_region.height - 1
        return [row_text(s, self.show_times, self.not_recorded) for s in self.nav.visible[top:top + height]]

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        if y == 0:  # the column header stays put while the rows scroll under it
            text = (" " + HEADER).ljust(max(width, len(HEADER) + 1))
            return Strip([Segment(text, self.get_component_rich_style("timeline--header"))]).crop(
                scroll_x, scroll_x + width)
        row = scroll_y + y - 1
        if row >= len(self.nav.visible):
            return Strip.blank(width, self.rich_style)
        info = self.nav.visible[row]
        cls = "timeline--cursor" if info.step == self.cursor else "timeline--row"
        style = self.get_component_rich_style(cls)
        text = (" " + row_text(info, self.show_times, self.not_recorded)).ljust(max(width, len(HEADER) + 1))
        return Strip([Segment(text, style)]).crop(scroll_x, scroll_x + width)

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        row = round(self.scroll_offset.y) + offset.y - 1
        if 0 <= row < len(self.nav.visible):
            self.post_message(self.Picked(self.nav.visible[row].step))
