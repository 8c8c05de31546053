"""Shutting `workbench serve` down on SIGTERM/SIGINT without cutting anyone off mid-sentence.

Owns: `DrainingServer`, a uvicorn server whose first signal starts a drain instead of closing
the listening socket: new requests get 503 (the socket stays open, so not "connection refused"),
running requests get `--graceful-timeout` seconds to finish, and when that runs out every open
stream ends with an error event and `data: [DONE]` (engine_loop.end_all), so uvicorn never has
to cancel a task (no CancelledError traceback). Only then does uvicorn shut down; the app's
lifespan closes the engine and finalizes the trace; a connection whose client stopped reading (a
/debug/events viewer that hangs) is closed rather than cancelled. A second signal exits at once. Does not own:
the app or the flags (cli_args.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import uvicorn

log = logging.getLogger("workbench.server")
FLUSH_WAIT = 2.0  # seconds the ended streams get to send their last frames


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, graceful_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.graceful_timeout = graceful_timeout
        self.drain_started: float | None = None
        self.streams_ended: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_started is not None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            self.should_exit = True
            return
        self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
        self.state.loop.begin_drain()  # new requests get 503 while running ones finish
        self.drain_started = time.monotonic()
        log.info("draining: %d open request(s) get %.1f s to finish", self.state.loop.open_requests,
                 self.graceful_timeout)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_started is None:
            return False
        loop, now = self.state.loop, time.monotonic()
        if self.streams_ended is None:
            if loop.open_requests and now - self.drain_started < self.graceful_timeout:
                return False
            if loop.open_requests:
                log.warning("drain time ran out: ending %d open request(s)", loop.open_requests)
                loop.end_all("the server is shutting down (the drain time ran out)")
            self.streams_ended = now
        if loop.open_requests and now - self.streams_ended < FLUSH_WAIT:
            return False
        self._close_stuck_connections()
        return True

    def _close_stuck_connections(self) -> None:
        """Close the /debug/events streams still open (a viewer that stopped reading blocks its writes,
        so its handler never sees the drain): each then sees its client gone and ends, instead of
        being cancelled with a traceback. Generation streams are left to finish sending."""
        busy = [c for c in self.server_state.connections if getattr(c, "cycle", None) is not None
                and not getattr(c.cycle, "response_complete", True)
                and str(c.cycle.scope.get("path", "")).startswith("/debug/events")]
        for conn in busy:
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        if busy:
            log.info("closed %d connection(s) whose client stopped reading", len(busy))
