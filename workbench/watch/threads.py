"""The watch's background threads (recorder, checker) run below the proxy's priority.

Owns `yield_to_traffic` (a thread's own nice value: Linux schedules threads, so the event loop
relaying chunks is served first when the cores are busy) and `check_threads` (the torch threads the
checker's reference may use: all cores but one, so one is left for the traffic). Standard library only.
"""

from __future__ import annotations

import os
import threading


def yield_to_traffic(niceness: int) -> None:
    """Lower the calling thread's CPU priority by `niceness` (a no-op where that is not possible)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread still runs
        pass


def check_threads() -> int:
    """Torch threads for the checker on the CPU: every core but one (at least one)."""
    return max(1, (os.cpu_count() or 2) - 1)
