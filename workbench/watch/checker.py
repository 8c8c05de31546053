"""The watch's checker: sampled requests teacher-forced through the reference, off the hot path.

Owns: a bounded queue (`submit` never blocks: when the checker falls behind, the request is dropped,
counted in `workbench_watch_check_dropped_total` and said in /watch/status), a thread that starts
the scorer (scorer.py: the reference `Engine`, as `workbench check` loads it, in a process of its
own) and has it score what is queued in batches (up to `batch` requests in one prefill, through
`workbench.external.check.score`: the same verdicts as `check`, with the same tolerance and floor), and what
follows each batch: its rows added to the `checks`
table of the trace file that holds each request, the metrics and the live view. Does not own the
verdicts' rules (external/check.py) or the recording (recorder.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from typing import Any

from workbench.external.check_report import CheckReport, RequestCheck
from workbench.watch.metrics import LiveStatus, WatchMetrics
from workbench.watch.recorder import CheckItem
from workbench.watch.threads import yield_to_traffic


class Checker:
    """Scores `CheckItem`s in a thread of its own through `scorer` (scorer.py), started there."""

    def __init__(self, scorer: Any, *, metrics: WatchMetrics, status: LiveStatus,
                 tolerance: float, capacity: int = 256, batch: int = 8, reference: str = "smollm2",
                 floor: dict[str, Any] | None = None) -> None:
        if not 1 <= capacity <= 1_000_000:
            raise ValueError(f"check queue capacity must be in [1, 1000000], got {capacity}")
        if not 1 <= batch <= 256:
            raise ValueError(f"check batch must be in [1, 256], got {batch}")
        self.scorer, self.metrics, self.status = scorer, metrics, status
        self.tolerance, self.batch, self.capacity, self.reference = tolerance, batch, capacity, reference
        self.floor = floor  # the measured floor's summary, stored beside each file's figures
        self.queue: queue.Queue[CheckItem] = queue.Queue(maxsize=capacity)
        self.dropped = 0
        self.max_depth = 0  # the deepest the queue has been (bounded by `capacity`)
        self.positions = 0
        self.error: str | None = None  # the reference failed to load: nothing is checked
        self._stop = threading.Event()
        self._reports: dict[str, list[RequestCheck]] = defaultdict(list)  # per trace file, for its summary
        self._thread = threading.Thread(target=self._run, name="watch-checker", daemon=True)
        self._thread.start()

    def submit(self, item: CheckItem) -> bool:
        """Queue a sampled request; never blocks (a full queue drops it, counted)."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self.metrics.dropped.inc()
            self.status.note("the checker fell behind: sampled requests were dropped (see "
                             "workbench_watch_check_dropped_total); lower --sample or raise --check-batch")
            return False
        self.max_depth = max(self.max_depth, self.queue.qsize())
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the batch in hand (what is still queued is not checked)."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def idle(self, timeout: float = 60.0) -> bool:
        """Wait until everything queued so far is checked (tests; shutdown)."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.queue.unfinished_tasks

    # --- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        yield_to_traffic(10)
        try:
            self.scorer.start()
            ready = True
            self.status.reference_state = "ready"
        except Exception as exc:  # nothing can be checked; the proxy goes on passing traffic
            self.error = f"the reference {self.reference!r} did not load: {type(exc).__name__}: {exc}"
            self.status.reference_state = "failed"
            self.status.note(self.error)
            ready = False
        while not self._stop.is_set():
            items = self._take()
            if items is None:
                break
            try:
                if ready:
                    self._check(items)
            except Exception as exc:
                self.metrics.check_errors.inc()
                self.status.note(f"a check batch failed: {type(exc).__name__}: {exc}")
            finally:
                for _ in items:
                    self.queue.task_done()
        self.scorer.close()

    def _take(self) -> list[CheckItem] | None:
        """The next batch (waits for its first item); None once `close()` was called."""
        while True:
            if self._stop.is_set():
                return None
            try:
                items = [self.queue.get(timeout=0.1)]
                break
            except queue.Empty:
                continue
        while len(items) < self.batch:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _check(self, items: list[CheckItem]) -> None:
        from workbench.trace.checks import add_checks

        t0 = time.perf_counter()
        results = self.scorer.score([it.scored for it in items])
        busy = time.perf_counter() - t0
        by_file: dict[str, list[RequestCheck]] = defaultdict(list)
        for it, rc in zip(items, results, strict=True):
            self.metrics.observe(rc)
            self.positions += len(rc.positions)
            by_file[it.trace].append(rc)
        for path, checks in by_file.items():
            report = self._reports[path]
            report.extend(checks)
            summary = CheckReport(path, self.reference, self.tolerance, report, source="external",
                                  floor=self.floor).summary()
            try:
                add_checks(path, {**summary, "watch": True}, [rc.to_row() for rc in checks])
            except (ValueError, OSError) as exc:  # the file was rotated away meanwhile
                self.status.note(f"check rows not stored: {exc}")
                self._reports.pop(path, None)
        if len(self._reports) > 64:  # summaries only for the recent files
            for old in list(self._reports)[:-64]:
                del self._reports[old]
        self.status.add([(rc, it.trace) for it, rc in zip(items, results)], busy,
                        time.perf_counter() - max(it.received for it in items))

