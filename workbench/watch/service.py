"""A running watch: the proxy, its recorder and its checker wired together, and the server that runs them.

Owns: `Watch` (builds the reference tokenizer, the rolling recorder, the checker with its bounded
queue, the metrics, the live status and the ASGI proxy; `close()` records and checks what is
queued, then stops) and `WatchServer` (uvicorn on a port, in the foreground for the command line or
on a thread for tests and notebooks). Does not own the proxy's behaviour (proxy.py), recording
(recorder.py) or checking (checker.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from workbench.watch.checker import Checker
from workbench.watch.metrics import LiveStatus, WatchMetrics
from workbench.watch.proxy import WatchProxy
from workbench.watch.recorder import Recorder
from workbench.watch.scorer import ProcessScorer, ThreadScorer
from workbench.watch.threads import check_threads


class Watch:
    """Everything behind `workbench watch --upstream URL`.

    `engine`: an existing `Engine` on the reference (tests reuse one; or `engine_factory()` builds
    one on the checker's thread); otherwise a process of the checker's loads `reference` on `device`; a `reference` that is a URL
    is a server teacher-forced through (vLLM's prompt logprobs), whose model's `tokenizer` (a model
    spec, default: `reference`, or smollm2 for a URL) reads the prompts and recovers token ids. `sample`: the fraction of generation requests checked.
    `floor`: a measured noise floor (a `Floor`, or the path of its file from `workbench floor`): positions
    are classified against it as `workbench check --floor` does, and the figures show it.
    """

    def __init__(self, upstream: str, *, out: str | Path = "watch-traces", sample: float = 0.1,
                 reference: str = "smollm2", tolerance: float | None = None, engine: Any = None,
                 device: str = "cpu", top: int = 5, max_bytes: int = 64 << 20, keep: int = 8,
                 check_capacity: int = 256, check_batch: int = 8, seed: int | None = None,
                 model: str | None = None, engine_factory: Any = None, tokenizer: str | None = None,
                 floor: Any = None) -> None:
        from workbench.external.check import DEFAULT_TOLERANCE
        from workbench.external.probe import base_url
        from workbench.external.token_ids import load_reference_tokenizer

        tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
            raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
        if floor is not None and not hasattr(floor, "bound"):
            from workbench.external.floor import load_floor

            floor = load_floor(floor)
        self.upstream = base_url(upstream)
        self.floor = floor
        self.metrics = WatchMetrics(floor)
        self.status = LiveStatus(upstream=self.upstream, sample=sample, tolerance=float(tolerance), reference=reference,
                                 floor=floor.summary() if floor is not None else None)

        remote = reference.startswith(("http://", "https://"))
        scorer: Any
        if engine is not None or engine_factory is not None or remote:  # a server reference waits on HTTP only
            def factory() -> Any:
                if engine is not None:
                    return engine
                if engine_factory is not None:
                    return engine_factory()
                from workbench.external.server_reference import ServerReference

                return ServerReference(reference, tokenizer or "smollm2")

            scorer = ThreadScorer(factory, float(tolerance), floor)
        else:  # the reference's Python in a process of its own, away from the proxy's interpreter lock
            scorer = ProcessScorer(reference, device=device, tolerance=float(tolerance), threads=check_threads(),
                                   floor=floor)
        self.checker = Checker(scorer, metrics=self.metrics, status=self.status, tolerance=float(tolerance),
                               capacity=check_capacity, batch=check_batch, reference=reference,
                               floor=floor.summary() if floor is not None else None)
        tok = load_reference_tokenizer(tokenizer or ("smollm2" if remote else reference))
        self.recorder = Recorder(out, tok, upstream=self.upstream, model=model, max_bytes=max_bytes, keep=keep,
                                 on_sampled=self.checker.submit)
        self.metrics.bind(self.checker.queue.qsize, check_capacity, lambda: self.recorder.dropped)
        self.proxy = WatchProxy(self.upstream, recorder=self.recorder, metrics=self.metrics, status=self.status,
                                sample=sample, top=top, seed=seed, status_extra=self._status_extra)

    def _status_extra(self) -> dict[str, Any]:
        return {"queue": {"depth": self.checker.queue.qsize(), "capacity": self.checker.capacity,
                          "max_depth": self.checker.max_depth, "dropped": self.checker.dropped},
                "recorder": {"recorded": self.recorder.recorded, "dropped": self.recorder.dropped,
                             "errors": self.recorder.errors, "last_error": self.recorder.last_error,
                             "queued": self.recorder.queue.qsize()},
                "traces": list(self.recorder.files), "upstream_takes_token_ids": self.proxy.ids_ok,
                "upstream_takes_logprobs": self.proxy.logprobs_ok}

    def settle(self, timeout: float = 60.0, *, checked: bool = True) -> bool:
        """Wait until every request proxied so far is recorded (and, with `checked`, checked)."""
        deadline = time.monotonic() + timeout
        while self.proxy.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        self.recorder.flush(max(0.0, deadline - time.monotonic()))
        return self.checker.idle(max(0.0, deadline - time.monotonic())) if checked else not self.proxy.in_flight

    def close(self) -> None:
        self.recorder.close()
        self.checker.close()


class WatchServer:
    """uvicorn serving a `Watch` on `host:port`; `start()` runs it on a thread (tests, notebooks)."""

    def __init__(self, watch: Watch, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from workbench.external.peers import free_port

        self.watch = watch
        self.host, self.port = host, port or free_port(host)
        # the upstream's own `date` and `server` headers pass through; uvicorn adds none of its own
        config = uvicorn.Config(watch.proxy, host=self.host, port=self.port, log_level="warning",
                                server_header=False, date_header=False, timeout_keep_alive=30, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> WatchServer:
        self._thread = threading.Thread(target=self.server.run, name="watch-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"watch: the proxy did not start on {self.url}")
            time.sleep(0.02)
        return self

    def run(self) -> None:
        """In the foreground until Ctrl-C (the command line)."""
        self.server.run()

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.watch.close()

    def __enter__(self) -> WatchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
