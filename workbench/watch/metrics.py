"""What the watch tells: its Prometheus metrics and the live view behind `/watch/status`.

Owns: `WatchMetrics` (one prometheus_client registry: requests by sampled or not, upstream errors,
positions checked by verdict, the |Δlogprob| histogram, requests checked and requests with a real
divergence, the checker's queue depth, capacity and drops, requests the recorder dropped; with a
measured floor, its bound per |logprob| band and the positions beyond it) and `LiveStatus`
(thread-safe: conformance per minute, the latest real divergences with each position's token beside
the reference's, the checker's rate, the floor beside the figures). Metric names start with
`workbench_watch_`, so they never collide with an upstream's when `/metrics` serves both. Does not
own computing verdicts (checker.py) or serving them (proxy.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from workbench.external.check_report import PositionCheck, RequestCheck

# as `workbench check`: `floor` (a greedy flip inside the engine's measured noise floor) only with --floor
VERDICTS = ("ok", "floor", "near_tie", "real", "logprob")
DELTA_BUCKETS = (1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0, 5.0)
BUCKET_S = 60  # conformance over time: one bucket a minute
LATEST = 20  # real divergences kept for the live view
CONTEXT = 24  # positions shown on each side of a divergence


class WatchMetrics:
    """The proxy's own Prometheus metrics (text exposition via `render()`); `floor`: a measured `Floor`."""

    def __init__(self, floor: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("workbench_watch_requests", "generation requests proxied", ["sampled"], registry=r)
        self.upstream_errors = Counter("workbench_watch_upstream_errors",
                                       "requests the upstream failed (unreachable: 502; dropped mid-stream)",
                                       registry=r)
        self.positions = Counter("workbench_watch_positions_checked", "output positions checked, by verdict",
                                 ["verdict"], registry=r)
        for v in VERDICTS:
            self.positions.labels(verdict=v)
        self.delta = Histogram("workbench_watch_abs_delta_logprob",
                               "|engine - reference logprob| of each checked position (nats)",
                               buckets=DELTA_BUCKETS, registry=r)
        self.checked = Counter("workbench_watch_requests_checked", "sampled requests checked", registry=r)
        self.real = Counter("workbench_watch_requests_real_divergence",
                            "checked requests with a real divergence (a greedy token beyond the tolerance, "
                            "or a sampled logprob off by more than it)", registry=r)
        self.queue_depth = Gauge("workbench_watch_check_queue_depth", "requests waiting for the checker",
                                 registry=r)
        self.queue_capacity = Gauge("workbench_watch_check_queue_capacity", "the checker queue's bound", registry=r)
        self.dropped = Counter("workbench_watch_check_dropped",
                               "sampled requests not checked: the checker's queue was full", registry=r)
        self.check_errors = Counter("workbench_watch_check_errors", "checker batches that failed", registry=r)
        self.trace_dropped = Gauge("workbench_watch_trace_dropped",
                                   "requests not recorded: the recorder's queue was full", registry=r)
        self.beyond_floor: Any = None
        if floor is not None:  # the floor beside the figures: its bounds, and how many positions exceed them
            bound = Gauge("workbench_watch_floor_bound", "the engine's own |delta logprob| bound by |logprob| band "
                          "(the measured noise floor, workbench floor)", ["band"], registry=r)
            for band in floor.summary()["bands"]:
                bound.labels(band=band["band"]).set(band["bound"])
            Gauge("workbench_watch_floor_max_flip_margin", "the largest reference margin at which the engine "
                  "flipped its own argmax between two runs (nats)", registry=r).set(floor.max_flip_margin)
            self.beyond_floor = Counter("workbench_watch_positions_beyond_floor", "checked positions whose "
                                        "|delta logprob| exceeds the floor's bound for their band", registry=r)

    def bind(self, queue_depth: Callable[[], float], capacity: int, trace_dropped: Callable[[], float]) -> None:
        self.queue_depth.set_function(queue_depth)
        self.queue_capacity.set(capacity)
        self.trace_dropped.set_function(trace_dropped)

    def observe(self, rc: RequestCheck) -> None:
        self.checked.inc()
        if rc.real:
            self.real.inc()
        for p in rc.positions:
            self.positions.labels(verdict=p.verdict).inc()
            if p.delta is not None:
                self.delta.observe(abs(p.delta))
                if self.beyond_floor is not None and p.floor is not None and abs(p.delta) > p.floor:
                    self.beyond_floor.inc()

    def render(self) -> str:
        from prometheus_client import exposition

        return exposition.generate_latest(self.registry).decode()


class LiveStatus:
    """The live view's data, written by the checker's thread and read by `/watch/status`."""

    def __init__(self, *, upstream: str, sample: float, tolerance: float, reference: str,
                 floor: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self.info = {"upstream": upstream, "sample": sample, "tolerance": tolerance, "reference": reference,
                     "floor": floor, "started": time.time()}
        self.totals = {"requests_checked": 0, "requests_real": 0, "positions": dict.fromkeys(VERDICTS, 0),
                       "beyond_floor": 0 if floor else None}
        self.buckets: deque[dict[str, Any]] = deque(maxlen=24 * 60)
        self.latest: deque[dict[str, Any]] = deque(maxlen=LATEST)
        self.busy_s = 0.0  # checker time spent scoring
        self.lag_s: float | None = None  # last batch: from its last chunk's arrival to its verdicts
        self.reference_state = "loading"
        self.notes: list[str] = []

    def note(self, line: str) -> None:
        with self._lock:
            if line not in self.notes:
                self.notes.append(line)

    def add(self, results: list[tuple[RequestCheck, str]], busy_s: float, lag_s: float) -> None:
        """One checker batch: each request's check and the trace file it went into."""
        now = time.time()
        with self._lock:
            self.busy_s += busy_s
            self.lag_s = lag_s
            start = int(now // BUCKET_S) * BUCKET_S
            if not self.buckets or self.buckets[-1]["t"] != start:
                self.buckets.append({"t": start, "requests": 0, "requests_real": 0,
                                     "positions": dict.fromkeys(VERDICTS, 0)})
            bucket = self.buckets[-1]
            for rc, trace in results:
                real = rc.real > 0
                self.totals["requests_checked"] += 1
                bucket["requests"] += 1
                if real:
                    self.totals["requests_real"] += 1
                    bucket["requests_real"] += 1
                    self.latest.appendleft(_divergence(rc, trace, now))
                for p in rc.positions:
                    self.totals["positions"][p.verdict] += 1
                    bucket["positions"][p.verdict] += 1
                    if self.totals["beyond_floor"] is not None and _beyond(p):
                        self.totals["beyond_floor"] += 1

    def snapshot(self, extra: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            positions = sum(self.totals["positions"].values())
            rate = positions / self.busy_s if self.busy_s > 0 else None
            return {**self.info, **extra, "reference_state": self.reference_state,
                    "totals": {**self.totals, "positions": dict(self.totals["positions"])},
                    "conformance": (self.totals["positions"]["ok"] / positions) if positions else None,
                    "over_time": [{**b, "positions": dict(b["positions"])} for b in self.buckets],
                    "latest_real": list(self.latest), "checker": {"busy_s": round(self.busy_s, 3),
                                                                  "positions_per_s": rate, "lag_s": self.lag_s},
                    "notes": list(self.notes)}


def _beyond(p: PositionCheck) -> bool:
    """|Δlogprob| above the engine's own spread for this token's band (with a floor)."""
    return p.floor is not None and p.delta is not None and abs(p.delta) > p.floor


def _divergence(rc: RequestCheck, trace: str, now: float) -> dict[str, Any]:
    """A real divergence for the live view: where, and the tokens around it beside the reference's."""
    first = next(p for p in rc.positions if p.verdict in ("real", "logprob"))
    lo, hi = max(0, first.position - CONTEXT), first.position + CONTEXT + 1
    tokens = [{"position": p.position, "engine": {"id": p.token_id, "text": p.text, "logprob": p.engine_logprob},
               "reference": {"id": p.ref_argmax, "text": p.ref_argmax_text, "logprob_of_engine_token": p.ref_logprob},
               "delta": p.delta, "floor": p.floor, "verdict": p.verdict}
              for p in rc.positions if lo <= p.position < hi]
    return {"req_id": rc.req_id, "trace": trace, "time": now, "greedy": rc.greedy, "position": first.position,
            "verdict": first.verdict, "engine": {"id": first.token_id, "text": first.text,
                                                 "logprob": first.engine_logprob},
            "reference": {"id": first.ref_argmax, "text": first.ref_argmax_text, "gap": first.gap,
                          "margin": first.ref_margin, "logprob_of_engine_token": first.ref_logprob},
            "floor": first.floor, "real_positions": rc.real, "inside_floor": rc.inside_floor, "tokens": tokens}
