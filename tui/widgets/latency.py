"""The latency pane: the selected request's waterfall from arrival to the socket.

Owns: drawing `workbench.trace.latency.RequestLatency` as text (a headline with TTFT, TPOT and
end to end, in the engine and at the socket; each stage's share; then one row per engine step:
schedule, forward, sample, output, and the frame that carried its tokens: buffered, hand-off,
deliver, serialize, write, on a shared time axis), and loading the request's `stamp` events in a
thread worker that posts `LatencyPane.Loaded` back (the only way the data reaches the pane).
The pane shows itself only for requests served over HTTP (their frames were stamped), so an
engine-only trace keeps the screen as it was. Does not own the arithmetic (workbench.trace.latency).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.message import Message

from tui.messages import LiveStatus
from tui.widgets.base import Pane, PaneContext
from workbench.trace.latency import RequestLatency, Segment
from workbench.trace.reader import TraceError

KINDS = ["stamp", "request.finished"]
BAR = 48  # columns of the time axis
MAX_ROWS = 400
STYLES = {"tokenize": "grey62", "queue": "cyan", "schedule": "steel_blue1", "forward": "blue", "sample": "magenta",
          "output": "dark_cyan", "buffered": "orange3", "handoff": "khaki3", "deliver": "dark_orange",
          "serialize": "hot_pink", "write": "green", "wait": "grey50"}
SHORT = {"tokenize": "tok", "queue": "queue", "schedule": "sched", "forward": "fwd", "sample": "samp",
         "output": "out", "buffered": "buf", "handoff": "hand", "deliver": "deliv", "serialize": "ser", "write": "write",
         "wait": "wait"}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f} ms"


def headline(lat: RequestLatency) -> Text:
    h = lat.headline()
    out = Text.assemble(("TTFT ", "bold"), _ms(h["ttft"]), ("  TPOT ", "bold"), _ms(h["tpot"]),
                        ("  end to end ", "bold"), _ms(h["e2e"]))
    if lat.has_server:
        out.append_text(Text.assemble(("   socket: first written ", "bold"), _ms(h["ttft_socket"]),
                                      ("  last ", "bold"), _ms(h["e2e_socket"])))
        summary = lat.summary or {}
        if summary.get("coalesced"):
            out.append(f"  coalesced {summary['coalesced']} deltas into {summary['chunks']} frames")
    if lat.aborted:
        out.append(f"  aborted: {lat.aborted}", "bold red")
    return out


def shares_text(lat: RequestLatency) -> Text:
    out = Text("shares ", style="bold")
    for stage, share in sorted(lat.shares().items(), key=lambda kv: -kv[1]):
        if share >= 0.0005:
            out.append(f"{SHORT.get(stage, stage)} {share * 100:.1f}%  ", STYLES.get(stage, ""))
    return out


def bar(segs: list[Segment], span: float, width: int = BAR) -> Text:
    """One row's segments on a time axis of `width` columns covering [0, span] seconds."""
    cells: list[str | None] = [None] * width
    for s in segs:  # later stages overwrite earlier ones only where they really are later
        a = min(width - 1, int(s.start / span * width)) if span > 0 else 0
        b = min(width, max(a + 1, round(s.end / span * width))) if span > 0 else 1
        for i in range(a, b):
            cells[i] = s.stage
    out = Text()
    for stage in cells:
        out.append("█" if stage else "·", STYLES.get(stage, "grey23") if stage else "grey23")
    return out


def rows_table(lat: RequestLatency) -> Table:
    segs = lat.segments()
    span = max((s.end for s in segs), default=0.0)
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    table.add_column("row", no_wrap=True)
    table.add_column(f"0 … {span * 1000:.1f} ms", no_wrap=True)
    table.add_column("stages (ms)", no_wrap=True)
    by_row: dict[int, list[Segment]] = {}
    for s in segs:
        by_row.setdefault(s.row, []).append(s)
    for row in sorted(by_row)[:MAX_ROWS]:
        mine = by_row[row]
        detail = Text()
        for s in mine:
            detail.append(f"{SHORT.get(s.stage, s.stage)} {(s.end - s.start) * 1000:.2f} ", STYLES.get(s.stage, ""))
        table.add_row(mine[0].label, bar(mine, span), detail)
    return table


def draw_latency(lat: RequestLatency | None, req_id: str | None) -> RenderableType:
    if req_id is None:
        return Text("no request selected", style="dim")
    if lat is None or lat.req_id != req_id:
        return Text("loading…", style="dim")
    if not lat.segments():
        return Text(f"no latency stamps for {req_id}", style="dim")
    return Group(headline(lat), shares_text(lat), rows_table(lat))


class LatencyPane(Pane):
    """The selected request's latency waterfall (loaded in a worker; shown for requests served over HTTP)."""

    TITLE = "Latency"
    WIDE = True

    class Loaded(Message):
        def __init__(self, latency: RequestLatency) -> None:
            super().__init__()
            self.latency = latency

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.latency: RequestLatency | None = None
        self._ctx: PaneContext | None = None
        self._asked: tuple[str | None, int] | None = None

    def show(self, ctx: PaneContext) -> None:
        self._ctx = ctx
        req_id = ctx.selection.req_id
        key = (req_id, id(ctx.request))  # a live trace replaces the request's data when it grows
        if key != self._asked:
            self._asked = key
            model = getattr(self.screen, "model", None)
            if req_id is not None and model is not None:
                self.run_worker(lambda: self._fetch(model.source, req_id), thread=True, exclusive=True,
                                group="latency")
        super().show(ctx)

    def _fetch(self, source: Any, req_id: str) -> None:
        """Worker thread: read the request's stamps (an indexed query) and post them back."""
        try:
            events = list(source.events(kind=KINDS, req_id=req_id))
        except TraceError as exc:  # a damaged trace: say so on the status line (the message bubbles up)
            self.post_message(LiveStatus(str(exc)))
            return
        self.post_message(self.Loaded(RequestLatency.from_events(req_id, events)))

    def on_latency_pane_loaded(self, message: Loaded) -> None:
        if self._ctx is None or message.latency.req_id != self._ctx.selection.req_id:
            return  # the selection moved on
        self.latency = message.latency
        self.display = message.latency.has_server
        super().show(self._ctx)

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_latency(self.latency, ctx.selection.req_id)

    def subtitle(self, ctx: PaneContext) -> str:
        lat = self.latency
        if lat is None or lat.req_id != ctx.selection.req_id:
            return ""
        return f"{lat.req_id} · {len(lat.steps)} steps · {len(lat.written)} frames written"
