"""Traces: the event schema, the recorder, the SQLite store and its reader, diff and export.

Nothing here imports torch, transformers or the engine: viewers use this package on machines with
no model. The store, reader and exports load on first use (`workbench.trace.open_trace`, ...), so
`import workbench.trace` stays cheap.
"""

from workbench.trace.events import SCHEMA_VERSION, Event
from workbench.trace.recorder import MemorySink, Tracer

_LAZY = {
    "open_trace": "workbench.trace.reader",
    "Trace": "workbench.trace.reader",
    "TraceError": "workbench.trace.reader",
    "TraceWriter": "workbench.trace.store",
    "export_perfetto": "workbench.trace.export",
    "export_tokens": "workbench.trace.export",
    "write_synthetic_trace": "workbench.trace.synth",
}

__all__ = ["SCHEMA_VERSION", "Event", "MemorySink", "Tracer", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.trace' has no attribute {name!r}")
