"""Giving a server's memory back when it goes idle, and reading where its resident memory lies.

Owns: `release_idle_memory` (the engine thread calls it when the engine goes idle: a full garbage
collection, then glibc's `malloc_trim`), `IdleSchedule` (how long into an idle spell it does so),
`pin_mmap_threshold` (glibc's `mallopt` at serve start), `freeze_startup_heap` (the collector
after start-up: serve and the benchmarks) and `resident_by_kind` (a process's RSS
split by mapping kind from /proc/PID/smaps, for the admission benchmark and its test). Does not
own: when the engine is idle (engine_loop.py).

Why a collection: a request that ends by its client leaving leaves garbage in reference cycles
(the exception and traceback of the cancelled handler, its frames, and whatever they hold: for a
5,000-prompt x n=16 request, its 80,000 request ids). Reference counting never frees a cycle, and
an idle server allocates too little for the collector's thresholds to trigger a full collection,
so without this the last big request stayed in memory until the next burst of traffic.
`gc.freeze()` at serve start moved the model and app out of the collector's sight, so a full
collection scans only what the requests since then left behind (milliseconds).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
# 1 MiB: glibc's own starting value (128 KiB) sends a decode step's mid-size tensors to mmap and
# page faults every step (7% of batch-32 throughput, measured); at 1 MiB the residual is the same
# and the throughput unchanged (BENCHMARKS.md, issue 19)
MMAP_THRESHOLD = 1 << 20
# seconds into an idle spell at which the engine thread hands memory back: once soon, and once
# more when the event loop has surely finished with the requests too (their handlers, the client's
# connection); what the event-loop thread frees after the first trim stayed in glibc's main heap
# (2 MB after a 5,000-prompt request, measured)
IDLE_RELEASE_AFTER = (0.25, 1.0)


class IdleSchedule:
    """When an idle engine hands memory back: at each of `after` seconds into an idle spell, and
    not again until the next spell."""

    def __init__(self, after: tuple[float, ...] = IDLE_RELEASE_AFTER) -> None:
        self.after = after
        self.since = 0.0
        self.done = len(after)  # hand-backs made in this spell (none due before the first step)

    def went_idle(self, now: float) -> None:
        self.since, self.done = now, 0

    def due(self, now: float) -> bool:
        """True (once per entry of `after`) when the next hand-back is due at `now`."""
        if self.done < len(self.after) and now - self.since >= self.after[self.done]:
            self.done += 1
            return True
        return False

    def wait(self, now: float, longest: float) -> float:
        """How long to sleep at `now`: `longest`, or less to wake for the next hand-back."""
        if self.done == len(self.after):
            return longest
        return min(longest, max(0.0, self.since + self.after[self.done] - now))


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim  # noqa: B018 (glibc only)
        return lib
    except (OSError, AttributeError):
        return None


def freeze_startup_heap() -> None:
    """Collect, then move everything alive (torch, transformers, the model, the app: about 400,000
    objects) into the collector's permanent generation, as vLLM does after start-up. A traced step
    makes thousands of short-lived objects, some of which live past a young collection (a trace
    writer holds a step's events for up to 0.1 s); each full collection those promotions trigger
    then scanned the whole start-up heap: 0.2 s, about every 150 traced steps at batch 32 (1.3 ms
    a step). Call it where nothing alive is dropped later: once the engine that lives as long as
    the process is built (serve), or before any engine exists (a benchmark that makes several): an
    engine frozen and then dropped would keep whatever its reference cycles hold. Unfrozen at exit,
    so that the exit collects as usual (triton's bindings report leaks otherwise)."""
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT.append(True)


_UNFREEZE_AT_EXIT: list[bool] = []


def release_idle_memory() -> None:
    """Free the garbage requests left in reference cycles, then return the C heap's free pages to
    the OS (glibc `malloc_trim`; a no-op elsewhere)."""
    gc.collect()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """glibc `mallopt(M_MMAP_THRESHOLD)` at serve start: blocks of `nbytes` and more get their own
    mapping, returned to the OS the moment they are freed. Setting it also turns off glibc's
    dynamic threshold, which after a large block (a packed weight, a prefill's logits) is freed
    raises the threshold up to 32 MB, so later mid-size tensors of every step land in the
    threads' arenas and stay there, fragmented, after the burst. True where it was set."""
    lib = _libc()
    return lib is not None and lib.mallopt(M_MMAP_THRESHOLD, nbytes) == 1


def resident_by_kind(pid: int) -> dict[str, float]:
    """RSS of process `pid` in MB by mapping kind: `heap` (the main malloc arena, [heap]), `anon`
    (anonymous mappings: glibc's other arenas and large blocks, pymalloc's arenas, thread stacks,
    tensors), `file` (file-backed: shared libraries' code and mmapped model weights) and `other`."""
    out = {"heap": 0.0, "anon": 0.0, "file": 0.0, "other": 0.0}
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=6)
        if "-" in first[0] and len(first) >= 5 and ":" in first[3]:  # a mapping's header line
            name = first[5] if len(first) > 5 else ""
            kind = "heap" if name == "[heap]" else "anon" if not name else "file" if name.startswith("/") else "other"
        elif line.startswith("Rss:"):
            out[kind] += int(first[1]) / 1024
    return out

