"""The peer processes a test run will need, started as soon as collection shows it needs them.

vLLM's server takes 45-75 s to start on the 2-core machines (imports and process spawning, about one
core busy), and the vLLM Python API rollouts script 30 s; started by the first test that needs them,
the run waits that long. A serial run of the suite keeps about 1.2 of the 2 cores busy, so these
start at nice 19 when collection ends, in the time the tests leave a core idle, and go back to nice 0
when their first test takes them (where the run may lower a nice value: root, as `make test` runs).
A start that fails is raised to every test that needs it, as the fixture's own start would be.
`stop_all()` at the session's end stops whatever was started and never taken.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BACKGROUND_NICE = 19

_started: dict[str, Any] = {}


def _renice(pid: int, value: int, group: bool = False) -> None:
    """Set a process's (or its whole group's) nice value; where this run may not lower it, leave it."""
    try:
        os.setpriority(os.PRIO_PGRP if group else os.PRIO_PROCESS, pid, value)
    except OSError:
        pass


class EarlyServer:
    """A PeerServer whose `start()` runs in a thread from now on, at nice 19 until `take()`."""

    def __init__(self, server: Any, receiver: Any = None) -> None:
        self.server, self.receiver, self.error = server, receiver, None
        server.status = False  # its status lines would land in whichever test's output is being captured
        self._thread = threading.Thread(target=self._start, name=f"early-{server.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while server.proc is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        if server.proc is not None:  # the processes it spawns from here on inherit the value
            _renice(server.proc.pid, BACKGROUND_NICE)

    def _start(self) -> None:
        try:
            self.server.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the test that takes the server
            self.error = exc

    def take(self) -> Any:
        """The started server (waiting for its start to end), its group back at nice 0."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        _renice(self.server.proc.pid, 0, group=True)
        return self.server

    def stop(self) -> None:
        self._thread.join()
        self.server.stop()
        if self.receiver is not None:
            self.receiver.__exit__(None, None, None)


@dataclass(slots=True)
class Rollouts:
    """vLLM's Python API generating rollouts (tests/helpers/vllm_rollouts.py) in its own process."""

    proc: subprocess.Popen
    out: Path
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(30)


def start_rollouts(folder: Path, nice: int = 0) -> Rollouts:
    from workbench.external.peers import peer_python, smollm2_folder

    out, log = folder / "rollouts.jsonl", folder / "vllm_rollouts.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(peer_python("vllm")), "-P", str(ROOT / "tests" / "helpers" / "vllm_rollouts.py"),
                                 str(smollm2_folder()), str(out)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    if nice:  # before it spawns anything: its processes inherit the value
        _renice(proc.pid, nice)
    return Rollouts(proc, out, log)


def start_for(items: list[Any]) -> None:
    """Start what the collected tests will need: the vLLM server and the rollouts script."""
    needed = set().union(*(getattr(item, "fixturenames", ()) for item in items)) if items else set()
    if "vllm_server" in needed and "vllm_server" not in _started:
        from workbench.external.otlp import OtlpReceiver

        receiver = OtlpReceiver().__enter__()
        _started["vllm_server"] = EarlyServer(vllm_server(receiver.endpoint), receiver)
    if "vllm_rollouts" in needed and "vllm_rollouts" not in _started:
        from workbench.external.peers import peer_python

        if peer_python("vllm").exists():  # else the fixture's own start fails with the reason
            folder = Path(tempfile.mkdtemp(prefix="workbench-rollouts-"))
            _started["vllm_rollouts"] = start_rollouts(folder, nice=BACKGROUND_NICE)


def vllm_server(otlp_endpoint: str) -> Any:
    """The session's vLLM server, not yet started: SmolLM2 in fp32, its spans sent to `otlp_endpoint`.

    `--enforce-eager`: no torch.compile at start-up (32 s to ready instead of 87 s on the 2-core EPYC);
    what the tests check (recording, watching, floors) is the server's API, not its speed."""
    from workbench.external.peers import VllmServer

    return VllmServer(otlp_endpoint=otlp_endpoint, extra_args=["--enforce-eager"])


def receiver() -> Any:
    """The OTLP receiver the early vLLM server exports to (None where none was started early)."""
    early = _started.get("vllm_server")
    return early.receiver if early is not None else None


def take(name: str) -> Any:
    """What was started early for fixture `name` (None if nothing was), at nice 0 from now on."""
    early = _started.pop(name, None)
    if isinstance(early, EarlyServer):
        _started[name + ".taken"] = early  # its receiver stays open until the session ends
        return early.take()
    if isinstance(early, Rollouts):
        _renice(early.proc.pid, 0, group=True)
    return early


def stop_all() -> None:
    """Stop everything started early (taken or not) at the session's end."""
    for early in list(_started.values()):
        try:
            early.stop()
        except Exception:  # noqa: BLE001 - a stop that fails must not hide the run's result
            pass
    _started.clear()
