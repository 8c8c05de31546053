"""The command palette (ctrl+p): jump to a step, select a request, search, filter, show a pane.

Owns `WorkbenchCommands`, a Textual command provider over the main screen: typing a number offers
"Jump to step N"; a request id offers "Select request ..." (at the step it arrived); any text offers
a token search and a request filter for it; the panes and the usual actions are listed when the
palette opens. Everything runs through the main screen's own methods. Does not draw anything.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from textual.command import DiscoveryHit, Hit, Provider

from tui.screens.compact import PANES

_STEP = re.compile(r"(?:step\s*|:)?(\d+)", re.IGNORECASE)


class WorkbenchCommands(Provider):
    def _screen(self) -> Any:
        from tui.screens.main import MainScreen

        screen = self.app.screen_stack[0] if self.app.screen_stack else None
        return screen if isinstance(screen, MainScreen) else None

    def _fixed(self, screen: Any) -> list[tuple[str, Callable[[], Any], str]]:
        out = [("Search tokens…", partial(screen.action_prompt, "search"), "/ : text, id=42, p<0.1, pos=7"),
               ("Filter requests…", partial(screen.action_prompt, "filter"), "f : keep the steps of matching requests"),
               ("Jump to step…", partial(screen.action_prompt, "jump"), ": : a step number"),
               ("First step", screen.action_first_step, "g"), ("Last step", screen.action_last_step, "G"),
               ("Next request in this batch", partial(screen.action_request, 1), "r"),
               ("Clear the filter", partial(screen.apply_filter, None, None), "f then Enter on nothing")]
        out += [(f"Show the {name} pane", partial(screen.action_show_pane, pane_id), f"{key} (small terminals)")
                for key, pane_id, name in PANES]
        return out

    async def discover(self) -> AsyncIterator[DiscoveryHit]:
        screen = self._screen()
        if screen is None:
            return
        for text, run, help in self._fixed(screen):
            yield DiscoveryHit(text, run, help=help)

    async def search(self, query: str) -> AsyncIterator[Hit]:
        screen = self._screen()
        if screen is None:
            return
        matcher = self.matcher(query)
        text = query.strip()
        if (m := _STEP.fullmatch(text)) is not None:
            yield Hit(1.0, f"Jump to step {m.group(1)}", partial(screen.jump, m.group(1)), help="select that step")
        if screen.model is not None and text:
            for info in screen.model.requests():
                score = matcher.match(info.req_id)
                if score > 0 and info.arrival_step is not None:
                    yield Hit(score, matcher.highlight(f"Select request {info.req_id}"),
                              partial(screen.select, info.arrival_step, info.req_id),
                              help=f"arrived at step {info.arrival_step}")
        if text and screen.model is not None:
            yield Hit(0.5, f"Search tokens for {text!r}", partial(screen.start_search, text, True), help="like /")
            yield Hit(0.4, f"Filter requests by {text!r}", partial(screen.filter_requests, screen.model, text),
                      help="like f")
        for label, run, help in self._fixed(screen):
            score = matcher.match(label)
            if score > 0:
                yield Hit(score * 0.9, matcher.highlight(label), run, help=help)
