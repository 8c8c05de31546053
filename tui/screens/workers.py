"""The main screen's background work: opening, loading a selection, following, searching, filtering.

Owns `ScreenWorkers`, a mixin of Textual workers (and, in live mode, the one look at whether the
URL is a `workbench watch` proxy). Each runs off the UI thread (or, for the SSE
stream, as an asyncio task) and reports only by posting a message from `tui.messages`; none of
them touches a widget. Does not own what the messages do to the screen (screens/main.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual import work
from textual.screen import Screen
from textual.worker import get_current_worker

from tui.live import LiveTrace, describe_server, follow_sse
from tui.messages import (
    FilterReady,
    LiveStatus,
    Loaded,
    OpenFailed,
    SearchDone,
    StepsChanged,
    TraceReady,
    VocabReady,
    WatchFound,
)
from tui.model import TraceModel, open_source
from tui.nav import Selection
from tui.search import Query, find
from workbench.trace.events import Event
from workbench.trace.live import TraceView
from workbench.trace.reader import StepInfo, TraceError

FILE_POLL_SECONDS = 0.25
# what a damaged trace can raise past the reader's checks (a payload of the right types but odd shape)
DAMAGE = (TraceError, ValueError, TypeError, KeyError, IndexError, AttributeError, OSError)


def reported(fn: Callable[..., None]) -> Callable[..., None]:
    """A worker body that reports damage on the status line instead of failing the worker (which
    would end the app with WorkerFailed); the screen keeps what it already shows."""

    @functools.wraps(fn)
    def run(self: ScreenWorkers, *args: Any, **kwargs: Any) -> None:
        try:
            fn(self, *args, **kwargs)
        except DAMAGE as exc:
            text = str(exc) if isinstance(exc, TraceError) else f"damaged trace: {type(exc).__name__}: {exc}"
            self.post_message(LiveStatus(text.splitlines()[0][:300] if text else type(exc).__name__))
            return
        model = next((a for a in args if isinstance(a, TraceModel)), None)
        problem = model.take_problem() if model is not None else None
        if problem:
            self.post_message(LiveStatus(problem))

    return run


@dataclass(frozen=True, slots=True)
class Options:
    """How the TUI was started (from `tui.main` or a test)."""

    path: str | None = None
    source: TraceView | None = None
    live_url: str | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    show_times: bool = True
    start_step: int | None = None
    start_request: str | None = None


def match_requests(model: TraceModel, query: str) -> frozenset[str]:
    """Requests whose id equals or contains `query`, or whose prompt contains it (smart case)."""
    fold = query == query.lower()
    needle = query.lower() if fold else query
    out = set()
    for info in model.requests():
        prompt = str(info.added.prompt) if info.added is not None else ""
        hay = prompt.lower() if fold else prompt
        if query == info.req_id or query in info.req_id or needle in hay:
            out.add(info.req_id)
    return frozenset(out)


class ScreenWorkers(Screen):
    """Workers of the main screen; each posts one of tui.messages."""

    options: Options
    model: TraceModel | None

    @work(thread=True, exclusive=True, group="open")
    def open_trace(self) -> None:
        opts = self.options
        try:
            source = opts.source or (LiveTrace(opts.live_url) if opts.live_url else open_source(opts.path or ""))
            model = TraceModel(source)
            steps = model.steps()
        except DAMAGE as exc:
            self.post_message(OpenFailed(str(exc)))
            return
        self.post_message(TraceReady(model, steps))

    @work(thread=True, exclusive=True, group="vocab")
    def load_vocab(self, model: TraceModel) -> None:
        try:
            ready = model.load_vocab(self.options.tokenizer)
        except ValueError as exc:
            self.post_message(LiveStatus(str(exc)))
            return
        if ready:
            self.post_message(VocabReady())

    @work(thread=True, exclusive=True, group="load")
    @reported
    def load_selection(self, model: TraceModel, sel: Selection, info: StepInfo | None) -> None:
        if sel.step is None:
            return
        view = model.step_view(sel.step, info)
        if get_current_worker().is_cancelled:
            return
        request = model.request(sel.req_id) if sel.req_id is not None else None
        self.post_message(Loaded(sel, view, request))

    @work(thread=True, exclusive=True, group="follow")
    @reported
    def follow_file(self, model: TraceModel) -> None:
        """Poll a trace file that is still being written; post the new step list when it grows."""
        worker = get_current_worker()
        while not worker.is_cancelled and not model.source.finished:
            time.sleep(FILE_POLL_SECONDS)
            try:
                grew = model.refresh()
            except TraceError as exc:
                self.post_message(LiveStatus(f"stopped following: {exc}"))
                return
            if grew:
                self.post_message(StepsChanged(model.steps(), None, None))
        self.post_message(LiveStatus("file complete"))

    @work(exclusive=True, group="follow")
    async def follow_live(self, model: TraceModel, url: str) -> None:
        """Follow a server's SSE stream (an asyncio task: cancelled cleanly on exit)."""
        live = model.source
        if not isinstance(live, LiveTrace):
            raise TypeError("follow_live needs a LiveTrace source")

        def on_events(events: list[Event]) -> None:
            touched = live.add(events)
            model.invalidate_tail(touched.steps, touched.req_ids)
            self.post_message(StepsChanged(live.steps(), touched.steps, touched.req_ids))

        def on_info(info: dict[str, Any]) -> None:
            if info.get("kind") == "server.hello" and info.get("model"):
                live.meta["model"] = {"name": str(info["model"])}
                live.meta["engine"] = info.get("engine")
            self.post_message(LiveStatus(describe_server(info), server=True))

        await follow_sse(url, on_events, lambda text: self.post_message(LiveStatus(text)), on_info,
                         self.options.api_key)

    @work(thread=True, exclusive=True, group="watch-probe")
    def probe_watch(self, url: str) -> None:
        """Is the live URL a `workbench watch` proxy? One GET of its `/watch/status`; posts WatchFound if so."""
        from tui.conformance import read_status, status_url

        try:
            status = status_url(url)
            read_status(status, self.options.api_key)
        except ValueError:
            return  # a `workbench serve` (or anything else): live mode as before
        self.post_message(WatchFound(status))

    @work(thread=True, exclusive=True, group="search")
    @reported
    def search(self, model: TraceModel, text: str, start: int, last: int, forward: bool,
               allowed: frozenset[str] | None) -> None:
        worker = get_current_worker()
        hit = find(model.source, Query.parse(text), start, last, forward, allowed, lambda: worker.is_cancelled)
        if not worker.is_cancelled:
            self.post_message(SearchDone(text, hit))

    @work(thread=True, exclusive=True, group="filter")
    @reported
    def filter_requests(self, model: TraceModel, query: str) -> None:
        self.post_message(FilterReady(query, match_requests(model, query)))
