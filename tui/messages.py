"""The typed messages workers post to the main screen (the only way data reaches the widgets).

Owns the message records. Workers (threads or the live asyncio task) post them; handlers on the
UI thread apply them. Nothing here touches a widget.
"""

from __future__ import annotations

from textual.message import Message

from tui.model import TraceModel
from tui.nav import Selection
from tui.search import SearchHit
from tui.stepview import RequestData, StepView
from workbench.trace.reader import StepInfo


class TraceReady(Message):
    """The trace is open and its step summaries are read."""

    def __init__(self, model: TraceModel, steps: list[StepInfo]) -> None:
        super().__init__()
        self.model, self.steps = model, steps


class OpenFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class Loaded(Message):
    """The step view and request output for a selection."""

    def __init__(self, selection: Selection, view: StepView, request: RequestData | None) -> None:
        super().__init__()
        self.selection, self.view, self.request = selection, view, request


class StepsChanged(Message):
    """A live trace grew: the new step list, and which steps and requests changed (None: maybe all)."""

    def __init__(self, steps: list[StepInfo], touched_steps: set[int] | None, touched_reqs: set[str] | None) -> None:
        super().__init__()
        self.steps, self.touched_steps, self.touched_reqs = steps, touched_steps, touched_reqs


class SearchDone(Message):
    def __init__(self, query: str, hit: SearchHit | None) -> None:
        super().__init__()
        self.query, self.hit = query, hit


class FilterReady(Message):
    def __init__(self, query: str, req_ids: frozenset[str]) -> None:
        super().__init__()
        self.query, self.req_ids = query, req_ids


class LiveStatus(Message):
    """Connection or follower news (`server=True`: the server's own gauges, shown beside it)."""

    def __init__(self, text: str, server: bool = False) -> None:
        super().__init__()
        self.text, self.server = text, server


class VocabReady(Message):
    """A tokenizer was loaded: ids can now be shown as text."""


class WatchFound(Message):
    """The live URL is a `workbench watch` proxy: its `/watch/status` answered (live mode opens its conformance view)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
