"""The main screen: the step timeline beside the panes, every key binding, and the selection.

Owns: composing the panes, the bindings (the help overlay lists them from here), moving the
selection (step, request, token), the command line's search / filter / jump, copy, and applying
what the workers post (tui.messages). Widgets are touched only here, on the UI thread. Does not own
loading (screens/workers.py) or drawing any pane (tui/widgets).
"""

from __future__ import annotations

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static

from tui import messages as msg
from tui.model import TraceModel
from tui.nav import Navigator, Selection, pick_request
from tui.screens.bisect import BisectScreen
from tui.screens.compact import COMPACT_BINDINGS, CompactPanes, PaneBar
from tui.screens.help import HelpScreen
from tui.screens.workers import Options, ScreenWorkers
from tui.search import Query, SearchHit
from tui.stepview import RequestData, StepView
from tui.widgets.base import Pane, PaneContext
from tui.widgets.batch import BatchPane
from tui.widgets.cmdline import CommandLine
from tui.widgets.detok import DetokPane
from tui.widgets.finish import FinishPane
from tui.widgets.latency import LatencyPane
from tui.widgets.layers import LayersPane
from tui.widgets.sampling import SamplingPane
from tui.widgets.spec import SpecPane
from tui.widgets.timeline import StepTimeline
from tui.widgets.tokens import TokensPane

PAGE = 10
PROMPT_KEYS = {"slash": "search", "f": "filter", "colon": "jump"}


class MainScreen(CompactPanes, ScreenWorkers):
    # Screen classes for tui.tcss: a narrow or short terminal gives the panes more of its room.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-compact"), (30, "-short"), (40, "-tall")]  # -compact: panes as tabs
    BINDINGS = [
        Binding("n,j,down", "next_step", "Next step"),
        Binding("p,k,up", "prev_step", "Prev step"),
        Binding("pagedown,ctrl+d", f"page({PAGE})", f"{PAGE} steps on", show=False),
        Binding("pageup,ctrl+u", f"page(-{PAGE})", f"{PAGE} steps back", show=False),
        Binding("g,home", "first_step", "First step", show=False),
        Binding("G,end", "last_step", "Last step (live: follow new steps)", show=False),
        Binding("l,right", "token(1)", "Next token of the request (jumps to its step)", show=False),
        Binding("h,left", "token(-1)", "Previous token of the request", show=False),
        Binding("r", "request(1)", "Next request in this step's batch", show=False),
        Binding("R", "request(-1)", "Previous request in this step's batch", show=False),
        Binding("slash", "prompt('search')", "Search"),
        Binding("right_square_bracket", "search_again(True)", "Next search match", show=False),
        Binding("left_square_bracket", "search_again(False)", "Previous search match", show=False),
        Binding("f", "prompt('filter')", "Filter"),
        Binding("F", "follow", "Follow the selected request (toggle)", show=False),
        Binding("colon", "prompt('jump')", "Jump to step", show=False),
        Binding("y", "copy_text", "Copy the request's text (OSC 52)", show=False),
        Binding("Y", "copy_pane", "Copy the focused pane's text", show=False),
        Binding("b", "bisect", "Bisect result of the selected token's request (workbench bisect)", show=False),
        Binding("escape", "clear", "Clear the search mark (also closes help and the command line)", show=False),
        Binding("w", "conformance", "Conformance: a watch proxy's live view (live mode)", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),  # a trace opened from the conformance view: back to it
    ] + COMPACT_BINDINGS

    def __init__(self, options: Options) -> None:
        super().__init__()
        self.options = options
        self.model: TraceModel | None = None
        self.nav = Navigator()
        self.sel = Selection()
        self.view: StepView | None = None
        self.request: RequestData | None = None
        self.hit: SearchHit | None = None
        self.query_text: str | None = None
        self.filter_label: str | None = None
        self.tail = options.live_url is not None
        self.note = "opening…"
        self.server_note = ""
        self.watch_url: str | None = None  # the live URL's /watch/status, when it is a watch proxy

    # --- layout ----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Horizontal(id="body"):
            yield StepTimeline(id="timeline")
            with Vertical(id="right"):
                yield PaneBar(id="panebar")
                yield BatchPane(id="batch")
                yield SamplingPane(id="sampling")
                with Horizontal(id="lower"):
                    with Vertical(classes="pane-column", id="col-left"):
                        yield TokensPane(id="tokens")
                        yield DetokPane(id="detok")
                    with Vertical(classes="pane-column", id="col-right"):
                        yield SpecPane(id="spec")
                        yield FinishPane(id="finish")
                yield LatencyPane(id="latency")  # shows itself for requests served over HTTP
                yield LayersPane(id="layers")  # shows itself for traces with capture (`i`: always)
        yield CommandLine(id="cmdline")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(StepTimeline).focus()
        self.show_pane(self.shown_pane)
        self.refresh_status()
        self.open_trace()

    @property
    def timeline(self) -> StepTimeline:
        return self.query_one(StepTimeline)

    def panes(self) -> list[Pane]:
        return list(self.query(Pane))

    # --- selection -------------------------------------------------------------------------------

    def select(self, step: int | None, req_id: str | None = None, position: int | None = None) -> None:
        """Show `step` (with `req_id` and output `position` when given); the data loads in a worker."""
        if step is None or self.model is None:
            return
        info = self.nav.info(step) or next((s for s in self.nav.steps if s.step == step), None)
        if req_id is None:
            order = self.view.req_order() if self.view is not None and self.view.step == step else []
            req_id = pick_request(order or list(info.req_ids if info else ()), self.sel.req_id, self.nav.filter_ids)
        self.sel = Selection(step, req_id, position)
        self.timeline.set_cursor(step)
        self.refresh_status()
        self.load_selection(self.model, self.sel, info)

    def redraw(self) -> None:
        """Redraw every pane from the loaded view (UI thread)."""
        if self.model is None:
            return
        ctx = PaneContext(self.view, self.request, self.sel, self.model.vocab, self.options.show_times, self.hit,
                          self.model.not_recorded)
        for pane in self.panes():
            pane.show(ctx)
        self.refresh_status()

    def refresh_status(self) -> None:
        parts = [self.model.title() if self.model is not None else (self.options.path or self.options.live_url or "")]
        if self.sel.step is not None:
            row = self.nav.index(self.sel.step)
            where = f"{row + 1}/{len(self.nav)}" if row is not None else "hidden by filter"
            parts.append(f"step {self.sel.step} ({where})")
        if self.sel.req_id is not None:
            parts.append(f"request {self.sel.req_id}")
        if self.filter_label:
            parts.append(self.filter_label)
        if self.query_text:
            parts.append(f"/{self.query_text}")
        if self.tail:
            parts.append("following new steps")
        if self.note:
            parts.append(self.note)
        if self.server_note:
            parts.append(self.server_note)
        if self.watch_url:
            parts.append("a watch proxy (w: conformance)")
        self.query_one("#status", Static).update(" │ ".join(parts), layout=False)  # one fixed line

    # --- worker results --------------------------------------------------------------------------

    def on_trace_ready(self, message: msg.TraceReady) -> None:
        self.model = message.model
        self.note = ""
        self.nav.set_steps(message.steps)
        self.timeline.not_recorded = message.model.not_recorded
        self.timeline.set_rows(self.nav, self.options.show_times)
        start = self.options.start_step
        first = self.nav.last() if self.tail else self.nav.first()
        self.select(self.nav.nearest(start) if start is not None else first, self.options.start_request)
        self.load_vocab(self.model)
        if self.options.live_url:
            self.follow_live(self.model, self.options.live_url)
            self.probe_watch(self.options.live_url)
        elif not self.model.source.finished:
            self.note = "following a file being written"
            self.follow_file(self.model)
        self.refresh_status()

    def on_open_failed(self, message: msg.OpenFailed) -> None:
        self.note = f"cannot open: {message.error}"
        self.refresh_status()
        self.notify(message.error, title="cannot open trace", severity="error")

    def on_loaded(self, message: msg.Loaded) -> None:
        sel = message.selection
        if (sel.step, sel.req_id) != (self.sel.step, self.sel.req_id):
            return  # the user has moved on since this load started
        self.view, self.request = message.view, message.request
        rs = message.view.req(sel.req_id)
        if rs is not None and rs.tokens and sel.position not in rs.positions:
            self.sel = Selection(sel.step, sel.req_id, rs.tokens[0].position)
        self.redraw()

    def on_vocab_ready(self, message: msg.VocabReady) -> None:
        self.redraw()

    def on_steps_changed(self, message: msg.StepsChanged) -> None:
        self.nav.set_steps(message.steps)
        self.timeline.set_rows(self.nav, self.options.show_times)
        if self.tail or self.sel.step is None:
            last = self.nav.last()
            if last is not None and last != self.sel.step:
                self.select(last)
                return
        touched = message.touched_steps is None or self.sel.step in message.touched_steps
        mine = message.touched_reqs is None or self.sel.req_id in message.touched_reqs
        if touched or mine:
            self.select(self.sel.step, self.sel.req_id, self.sel.position)

    def on_live_status(self, message: msg.LiveStatus) -> None:
        if message.server:
            self.server_note = message.text
        else:
            self.note = message.text
        self.refresh_status()

    def on_watch_found(self, message: msg.WatchFound) -> None:
        self.watch_url = message.url
        self.refresh_status()
        self.action_conformance()

    def on_search_done(self, message: msg.SearchDone) -> None:
        self.hit = message.hit
        if message.hit is None:
            self.note = f"not found: {message.query}"
            self.refresh_status()
            self.redraw()
            return
        self.note = f"match at step {message.hit.step}, {message.hit.req_id} position {message.hit.position}"
        self.select(message.hit.step, message.hit.req_id, message.hit.position)

    def on_filter_ready(self, message: msg.FilterReady) -> None:
        if not message.req_ids:
            self.note = f"no request matches {message.query!r}"
            self.refresh_status()
            return
        n, self.note = len(message.req_ids), ""  # a success replaces an earlier "no request matches"
        self.apply_filter(message.req_ids, f"filter {message.query!r}: {n} request{'s' * (n != 1)}")

    def apply_filter(self, req_ids: frozenset[str] | None, label: str | None) -> None:
        self.nav.set_filter(req_ids)
        self.filter_label = label
        self.timeline.set_rows(self.nav, self.options.show_times)
        keep = self.sel.req_id if req_ids is None or self.sel.req_id in req_ids else None
        step = self.sel.step if self.nav.index(self.sel.step) is not None else self.nav.nearest(self.sel.step or 0)
        self.sel = Selection(self.sel.step, keep, self.sel.position)
        self.select(step, keep, self.sel.position if keep else None)

    def on_key(self, event: events.Key) -> None:
        """Open the command line as the key arrives and hand it the keys typed right behind: bindings run
        after every queued key has gone to the old focus, so `/the rocks` typed fast would lose its text;
        `/`, `f` and `:` are handled here instead (their BINDINGS entries stay for the footer and help)."""
        line = self.query_one(CommandLine)
        if line.has_class("open"):
            if not line.saw(event):  # it went to the old focus: replay it into the line, in order
                event.stop()
                event.prevent_default()
                line.type_ahead(event)
            return
        mode = PROMPT_KEYS.get(event.key)
        if mode is not None:
            event.stop()
            event.prevent_default()
            line.open(mode)

    @on(StepTimeline.Picked)
    def _picked(self, event: StepTimeline.Picked) -> None:
        self.tail = False
        self.select(event.step)

    @on(CommandLine.Done)
    def _command(self, event: CommandLine.Done) -> None:
        self.timeline.focus()
        if event.mode == "jump":
            self.jump(event.value)
        elif event.mode == "filter":
            if not event.value:
                self.apply_filter(None, None)
            elif self.model is not None:
                self.filter_requests(self.model, event.value)
        elif event.value:
            self.start_search(event.value, forward=True)

    # --- actions ---------------------------------------------------------------------------------

    def move(self, delta: int) -> None:
        step = self.nav.move(self.sel.step, delta)
        self.tail = self.tail and step == self.nav.last() and delta > 0
        self.select(step)

    def action_next_step(self) -> None:
        self.move(1)

    def action_prev_step(self) -> None:
        self.move(-1)

    def action_page(self, delta: int) -> None:
        self.move(delta)

    def action_first_step(self) -> None:
        self.tail = False
        self.select(self.nav.first())

    def action_last_step(self) -> None:
        self.tail = self.options.live_url is not None or (self.model is not None and not self.model.source.finished)
        self.select(self.nav.last())

    def action_token(self, delta: int) -> None:
        data = self.request
        if data is None or not data.tokens or self.sel.step is None:
            return
        i = data.index_of(self.sel.position)
        if i is None:  # no token selected here: take the nearest one in the direction asked
            after = [j for j, t in enumerate(data.tokens) if t.step >= self.sel.step]
            before = [j for j, t in enumerate(data.tokens) if t.step <= self.sel.step]
            i = (after[0] if after else len(data.tokens) - 1) if delta > 0 else (before[-1] if before else 0)
        else:
            i = min(max(i + delta, 0), len(data.tokens) - 1)
        tok = data.tokens[i]
        self.tail = False
        self.select(tok.step, data.req_id, tok.position)

    def action_request(self, delta: int) -> None:
        if self.view is None:
            return
        allowed = self.nav.filter_ids
        order = [r for r in self.view.req_order() if allowed is None or r in allowed]
        if not order:
            return
        i = order.index(self.sel.req_id) if self.sel.req_id in order else -1 if delta > 0 else 0
        self.select(self.sel.step, order[(i + delta) % len(order)])

    def action_prompt(self, mode: str) -> None:
        self.query_one(CommandLine).open(mode)

    def jump(self, value: str) -> None:
        try:
            step = int(value)
        except ValueError:
            self.note = f"jump: not a step number: {value!r}"
            self.refresh_status()
            return
        self.tail = False
        self.select(self.nav.nearest(step))

    def start_search(self, text: str, forward: bool) -> None:
        try:
            Query.parse(text)
        except ValueError as exc:
            self.note = str(exc)
            self.refresh_status()
            return
        if self.model is None or self.sel.step is None:
            return
        self.query_text, self.note, self.tail = text, "searching…", False
        self.refresh_status()
        last = self.nav.steps[-1].step if self.nav.steps else 0
        self.search(self.model, text, self.sel.step, last, forward, self.nav.filter_ids)

    def action_search_again(self, forward: bool) -> None:
        if self.query_text:
            self.start_search(self.query_text, forward)

    def action_follow(self) -> None:
        if self.filter_label and self.filter_label.startswith("following"):
            self.apply_filter(None, None)
        elif self.sel.req_id is not None:
            self.apply_filter(frozenset({self.sel.req_id}), f"following {self.sel.req_id}")

    def action_copy_text(self) -> None:
        data = self.request
        if data is None or self.sel.step is None:
            return
        done = data.finished is not None and data.finished.step <= self.sel.step
        text = data.finished.text if done and data.finished is not None else data.text_until(self.sel.step)
        self.app.copy_to_clipboard(text)
        self.notify(f"copied {len(text)} characters of {data.req_id}", timeout=2)

    def action_copy_pane(self) -> None:
        focused = self.focused
        if isinstance(focused, Pane):
            text = focused.text()
        else:
            text = "\n".join(self.timeline.visible_rows())
        self.app.copy_to_clipboard(text)
        self.notify(f"copied {len(text)} characters", timeout=2)

    def action_clear(self) -> None:
        self.hit, self.query_text, self.note = None, None, ""
        self.redraw()

    def action_bisect(self) -> None:
        data = self.request
        if data is None or not data.bisects:
            rid = data.req_id if data is not None else "REQ"
            self.notify(f"no bisect stored for {rid} (workbench bisect FILE --at {rid}:POS)", severity="warning")
            return
        self.app.push_screen(BisectScreen(data.req_id, data.bisects, self.sel.position))

    def action_conformance(self) -> None:
        """Live mode on a `workbench watch` proxy: its conformance over time and latest real divergences."""
        from tui.conformance import status_url
        from tui.screens.conformance import ConformanceScreen

        if self.options.live_url is None:
            self.notify("the conformance view follows a watch proxy: workbench tui --live URL", timeout=3)
            return
        url = self.watch_url or status_url(self.options.live_url)
        self.app.push_screen(ConformanceScreen(url, api_key=self.options.api_key, show_times=self.options.show_times))

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(list(self.BINDINGS)))

    async def action_quit(self) -> None:
        if self.app.screen_stack and self.app.screen_stack[0] is not self:  # opened from the conformance view
            self.app.pop_screen()
            return
        self.app.exit()
