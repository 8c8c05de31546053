"""Run an app under a real uvicorn server on a background thread (tests, benchmarks, notebooks).

Owns: `BackgroundServer`, which binds 127.0.0.1 on a free port, waits until the server (and its
lifespan, so the engine thread) is up, exposes the URL, and shuts down cleanly. Does not own the app.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class BackgroundServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 graceful_timeout: float = 5.0) -> None:
        import uvicorn

        self.app = app
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     timeout_graceful_shutdown=graceful_timeout)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="workbench-uvicorn", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
