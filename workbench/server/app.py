"""The app factory: `create_app(engine, ...)` wires an engine into a FastAPI app.

Owns: building the app (routers, error handlers, static files), its state on
`app.state.workbench` (no module globals), the lifespan (the engine thread starts with the app
and stops with it), attaching the live-event and metrics sinks to the engine's tracer, and the
optional API key and the Host allow-list (guard.py), and wrapping everything in the
latency middleware (stream_latency.py: `X-Request-Id`, frame stamps, send timeout) with the
per-request stream limits. Does not own: serving logic, routes, or running uvicorn (serve.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from workbench.engine.api import EngineAPI
from workbench.server import routes_debug, routes_openai
from workbench.server.admission import AdmissionLimits
from workbench.server.engine_loop import EngineLoop
from workbench.server.errors import install_error_handlers
from workbench.server.event_hub import EventHub
from workbench.server.guard import LOOPBACK_HOSTS, APIKeyMiddleware, GuardMiddleware
from workbench.server.logprobs import TokenBytes
from workbench.server.metrics import Metrics
from workbench.server.output_buffer import StreamLimits
from workbench.server.serving import ServerState
from workbench.server.stream_latency import wrap_app
from workbench.trace.recorder import MemorySink

log = logging.getLogger("workbench.server")


def create_app(engine: EngineAPI, *, model_name: str | None = None, hub: EventHub | None = None,
               trace_dir: str | Path | None = None, trace_writer: Any = None, api_key: str | None = None,
               max_body_bytes: int = 4 << 20, default_max_tokens: int = 1024, close_engine: bool = False,
               stream_limits: StreamLimits | None = None, admission: AdmissionLimits | None = None,
               allowed_hosts: Sequence[str] = LOOPBACK_HOSTS, max_headers: int = 100,
               grammar_prestart: bool = False) -> FastAPI:
    """An OpenAI-compatible app over `engine`; the engine thread runs while the app is served.

    `stream_limits` bounds what one request may hold for a client that reads slowly (bytes) and how
    long one write may block (seconds) before the request is aborted (output_buffer.py).

    With `close_engine`, shutting the app down also closes the engine (its trace files are
    finished), for a caller that hands the engine over, as `workbench serve` does.

    With `grammar_prestart` (`workbench serve`'s default), structured output is made ready as the
    app starts, in the background: xgrammar imported and the grammar worker process started
    (`GrammarBackend.prestart`), so the first constrained request does not wait for them.

    Build the engine with `trace_sinks=[hub, ...]` so a long-running server keeps no events in
    memory; an engine with a `MemorySink` works but keeps every event (logged as a warning).
    """
    if hub is None:
        hub = EventHub()
    tracer = engine.tracer
    if hub not in tracer.sinks:
        tracer.add_sink(hub)
    if any(isinstance(s, MemorySink) for s in tracer.sinks):
        log.warning("the engine's tracer keeps every event in memory (MemorySink); pass trace_sinks= for a "
                    "long-running server")
    metrics = Metrics()
    tracer.add_sink(metrics.spec)
    state = ServerState(
        engine=engine, loop=EngineLoop(engine, on_finished=metrics.observe_finished, limits=stream_limits,
                                       admission=admission), hub=hub,
        metrics=metrics,
        model_name=model_name or str(engine.config.model), token_bytes=TokenBytes(engine.tokenizer),
        trace_dir=Path(trace_dir) if trace_dir is not None else None, trace_writer=trace_writer,
        api_key=api_key, max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
        created=int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        if grammar_prestart:
            engine.grammars.prestart()
        try:
            yield
        finally:
            await state.loop.stop()
            tracer.remove_sink(metrics.spec)
            if close_engine:
                engine.close()

    app = FastAPI(title="LLM Engine Workbench", version="0.1.0", lifespan=lifespan)
    app.state.workbench = state
    install_error_handlers(app, on_error=metrics.count_error)
    app.include_router(routes_openai.router)
    app.include_router(routes_debug.router)
    app.mount("/static", StaticFiles(directory=routes_debug.STATIC_DIR), name="static")
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(GuardMiddleware, allowed_hosts=allowed_hosts, max_headers=max_headers)  # outermost
    wrap_app(app, state)  # X-Request-Id on every response; frame stamps, send timeout (stream_latency.py)
    return app

