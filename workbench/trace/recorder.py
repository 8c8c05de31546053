"""The tracer the engine emits through, and the sinks that receive events.

Owns: trace levels at run time, fan-out of events to sinks (in-memory list, the SQLite store,
live subscribers). Does not own: what events mean (events.py) or how files are laid out (format.py).
`Tracer.on` is a plain attribute so that the engine's `if tracer.on:` guard is the only cost at
level `off`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from workbench.trace.events import Event, level_value


class Sink(Protocol):
    def write(self, event: Event) -> None: ...
    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None: ...
    def set_meta(self, key: str, value: Any) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class MemorySink:
    """Keeps every event (and tensor, as numpy arrays) in lists; what tests and notebooks read."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.tensors: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None:
        with self._lock:
            self.tensors[name] = array

    def set_meta(self, key: str, value: Any) -> None:
        self.meta[key] = value

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.kind == kind]


class Tracer:
    """Fan-out of events to sinks at a level: `off` (0), `summary` (1), `full` (2)."""

    def __init__(self, level: str = "off", sinks: list[Sink] | None = None) -> None:
        self.level = level
        self.rank = level_value(level)
        self.sinks: list[Sink] = list(sinks or [])
        self.on = self.rank > 0 and bool(self.sinks)
        self.full = self.rank >= 2 and self.on

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)
        self.on = self.rank > 0 and bool(self.sinks)
        self.full = self.rank >= 2 and self.on

    def remove_sink(self, sink: Sink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        self.on = self.rank > 0 and bool(self.sinks)
        self.full = self.rank >= 2 and self.on

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.write(event)

    def tensor(self, name: str, step: int, req_id: str | None, array: Any, *, captured: bool = False) -> None:
        """Store a tensor at level `full`; a `captured` one (asked for per request) whenever tracing is on."""
        if self.full or (captured and self.on):
            for sink in self.sinks:
                sink.write_tensor(name, step, req_id, array)

    def set_meta(self, key: str, value: Any) -> None:
        for sink in self.sinks:
            sink.set_meta(key, value)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
