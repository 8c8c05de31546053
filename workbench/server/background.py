"""Run a server in the background (tests, benchmarks, notebooks).

Owns: `BackgroundServer`, which runs an app under a real uvicorn server on a thread of this process
(binds 127.0.0.1 on a free port, waits until the server and its lifespan, so the engine thread, are
up, exposes the URL, shuts down cleanly); and `ServerProcess`, which runs `python -m workbench.server`
in its own process, as a user runs `workbench serve` beside a viewer or client, so that neither
shares an interpreter (GIL, garbage collector) with the other. Does not own the app.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
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


def _free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`python -m workbench.server <args> --port <free port>` in a child process, healthy on enter.

    `args` are `workbench serve` arguments without `--port`/`--host`; with `log_path` the server's
    output (its access log) is written there. Exiting sends SIGTERM (the
    server's graceful shutdown) and kills the process if it has not gone within `stop_timeout`.
    """

    def __init__(self, args: Sequence[str], *, host: str = "127.0.0.1", start_timeout: float = 300.0,
                 stop_timeout: float = 60.0, cwd: str | None = None, log_path: str | None = None) -> None:
        self.host = host
        self.port = _free_port(host)
        self.args = [*args, "--host", host, "--port", str(self.port)]
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.cwd = cwd
        self.log_path = log_path  # the server's stdout and stderr (its log) go here when given
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        import httpx

        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (the child keeps it)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "workbench.server", *self.args], cwd=self.cwd,
                                         env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy within {self.start_timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
