"""Live mode's conformance screen: a `workbench watch` proxy's live view, polled once a second.

Owns: `ConformanceScreen` (the summary with the floor beside the figures, conformance over time, the
latest real divergences as a table, and the selected one's tokens beside the reference's), its
poller (a thread worker that reads `/watch/status` and posts `WatchStatus`; it never touches a
widget) and its keys: `enter` shows a divergence's tokens, `t` asks the app to open its trace file
at that request in the main view (`OpenRequest`; the watch's traces hold the reference beside every
checked token), `escape` / `w` goes back. Does not own the drawings (tui/conformance.py) or the
status (workbench/watch/metrics.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static
from textual.worker import get_current_worker

from tui.conformance import divergence_text, latest_rows, over_time_text, read_status, summary_text

POLL_SECONDS = 1.0
COLUMNS = ("time", "request", "pos", "engine", "reference", "gap", "verdict", "trace")


class WatchStatus(Message):
    """One reading of `/watch/status` (or why there was none)."""

    def __init__(self, status: dict[str, Any] | None, error: str | None = None) -> None:
        super().__init__()
        self.status, self.error = status, error


class ConformanceScreen(Screen):
    """The watch proxy at `url` (its `/watch/status`); `status`: a reading to show without polling
    (screenshots and snapshots)."""

    class OpenRequest(Message):
        """Open the trace file at `path` on request `req_id` in the main view (the app does: it owns the screens)."""

        def __init__(self, path: str, req_id: str) -> None:
            super().__init__()
            self.path, self.req_id = path, req_id

    BINDINGS = [
        Binding("enter", "show", "Tokens beside the reference's"),
        Binding("t", "open_trace", "Open the request's trace"),
        Binding("escape,w", "back", "Back"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, url: str, *, api_key: str | None = None, show_times: bool = True,
                 status: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.url, self.api_key, self.show_times = url, api_key, show_times
        self.status: dict[str, Any] | None = status
        self.fixed = status is not None
        self.shown: dict[str, Any] | None = None  # the divergence whose tokens are on screen
        self.error: str | None = None
        self.readings = 0

    def compose(self) -> ComposeResult:
        yield Static(id="conf-summary")
        yield Static(id="conf-time")
        yield DataTable(id="conf-latest", cursor_type="row", zebra_stripes=True)
        with VerticalScroll(id="conf-detail-box"):
            yield Static(id="conf-detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        table.border_title = "latest real divergences (enter: tokens beside the reference's; t: open the trace)"
        self.query_one("#conf-detail-box").border_title = "tokens beside the reference's"
        self.query_one("#conf-summary").border_title = f"conformance · {self.url}"
        table.focus()
        if self.fixed:
            self.draw()
        else:
            self.poll()

    @work(thread=True, exclusive=True, group="watch")
    def poll(self) -> None:
        worker = get_current_worker()
        while not worker.is_cancelled:
            try:
                self.post_message(WatchStatus(read_status(self.url, self.api_key)))
            except ValueError as exc:
                self.post_message(WatchStatus(None, str(exc)))
            deadline = time.monotonic() + POLL_SECONDS
            while not worker.is_cancelled and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_watch_status(self, message: WatchStatus) -> None:
        self.readings += 1
        self.error = message.error
        if message.status is not None:
            self.status = message.status
        self.draw()

    def draw(self) -> None:
        """Redraw from the latest reading (UI thread); a reading that cannot be drawn is said, not raised."""
        summary = self.query_one("#conf-summary", Static)
        status = self.status
        if status is None:
            summary.update(Text(self.error or f"reading {self.url} …", style="bold red" if self.error else "dim"))
            return
        try:
            head = summary_text(status)
            if self.error:
                head.append(f"\nlast reading failed: {self.error}", "bold red")
            summary.update(head)
            self.query_one("#conf-time", Static).update(over_time_text(status, show_times=self.show_times))
            self._fill_table(latest_rows(status, self.show_times))
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # another process's JSON, oddly shaped
            summary.update(Text(f"the watch's status could not be drawn: {type(exc).__name__}: {exc}", "bold red"))
            return
        if self.shown is None and self.latest():
            self.show(self.latest()[0])

    def _fill_table(self, rows: list[tuple[str, ...]]) -> None:
        table = self.query_one(DataTable)
        keys = [f"{r[1]}@{r[7]}" for r in rows]
        current = [str(k.value) for k in table.rows]
        if keys == current:
            return
        row = table.cursor_row
        table.clear()
        for key, r in zip(keys, rows, strict=True):
            if key not in table.rows:
                table.add_row(*r, key=key)
        if rows:
            table.move_cursor(row=min(row, len(table.rows) - 1))

    def latest(self) -> list[dict[str, Any]]:
        return [d for d in (self.status or {}).get("latest_real") or [] if isinstance(d, dict)]

    def selected(self) -> dict[str, Any] | None:
        latest, row = self.latest(), self.query_one(DataTable).cursor_row
        return latest[row] if 0 <= row < len(latest) else None

    def show(self, d: dict[str, Any]) -> None:
        self.shown = d
        try:
            self.query_one("#conf-detail", Static).update(divergence_text(d))
        except (TypeError, ValueError, AttributeError) as exc:
            self.query_one("#conf-detail", Static).update(Text(f"cannot draw it: {exc}", "bold red"))

    @on(DataTable.RowHighlighted)
    @on(DataTable.RowSelected)
    def _highlighted(self, event: DataTable.RowHighlighted | DataTable.RowSelected) -> None:
        d = self.selected()
        if d is not None:
            self.show(d)

    def action_show(self) -> None:
        d = self.selected()
        if d is not None:
            self.show(d)

    def action_open_trace(self) -> None:
        """The request in the main view, its trace file's `checks` giving the reference beside each token."""
        d = self.shown or self.selected()
        if d is None:
            self.notify("no real divergence to open", timeout=3)
            return
        path = str(d.get("trace") or "")
        if not os.path.isfile(path):
            self.notify(f"the trace {path!r} is not on this machine (or was rotated away): open it where the "
                        "watch runs", title="cannot open", severity="warning")
            return
        self.post_message(self.OpenRequest(path, str(d.get("req_id"))))  # the app opens it (tui/app.py)

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()

    async def action_quit(self) -> None:
        self.app.exit()
