"""`workbench watch`: conformance of live traffic, checked token by token against the reference.

- `Watch(upstream, ...)` (service.py): the proxy (proxy.py, an ASGI app relaying every request and
  its answer unchanged), the recorder (recorder.py, rolling `.wbtrace` files in probe's schema) and
  the checker (checker.py, a bounded queue and a thread teacher-forcing sampled requests through the
  reference as `workbench check` does), with metrics and the live view (metrics.py).
- `WatchServer(watch)` (service.py): uvicorn serving it; `start()` on a thread, `run()` in the foreground.
- What a sampled request adds and how it is taken off the response byte for byte: rewrite.py.

Re-exports are lazy: importing this package imports neither httpx nor torch.
"""

from __future__ import annotations

_LAZY = {"Watch": "workbench.watch.service", "WatchServer": "workbench.watch.service"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.watch' has no attribute {name!r}")
