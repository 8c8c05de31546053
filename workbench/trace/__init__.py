"""Traces: the event schema, the recorder, the SQLite store and its reader, diff and export.

Nothing here imports torch, transformers or the engine: viewers use this package on machines with
no model.
"""

from workbench.trace.events import SCHEMA_VERSION, Event
from workbench.trace.recorder import MemorySink, Tracer

__all__ = ["SCHEMA_VERSION", "Event", "MemorySink", "Tracer", "open_trace"]


def __getattr__(name: str):
    if name == "open_trace":
        from workbench.trace.reader import open_trace

        return open_trace
    raise AttributeError(name)
