"""Prometheus metrics in the text exposition format (no client library needed).

Owns: latency histograms (TTFT, TPOT, inter-token latency, queue time, end-to-end), request and
token counters fed by finished requests (`observe_finished`, called on the engine thread), stream
metrics fed by each HTTP request's socket summary (`observe_stream`, on the event loop: engine
hand-off to socket write per frame, time to the first byte written, aborts by reason, coalesced
deltas), speculative-decoding
draft/accept counters fed by trace events (`SpecCounter`, a tracer sink), and rendering everything
with the engine gauges (running, waiting, KV usage) at scrape time. Does not own: the gauges'
source (engine_loop.EngineStats) or the HTTP route.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from workbench.trace.events import Event

PREFIX = "workbench"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class Histogram:
    """Cumulative-bucket histogram; thread-safe `observe`."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        with self._lock:
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for bound, c in zip(self.buckets, counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cum}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {n}')
        lines += [f"{self.name}_sum {total}", f"{self.name}_count {n}"]
        return lines


class SpecCounter:
    """A tracer sink counting speculative draft tokens proposed and accepted (engine thread)."""

    def __init__(self) -> None:
        self.proposed = 0
        self.accepted = 0

    def write(self, event: Event) -> None:
        if event.kind == "spec.verify":
            self.proposed += len(getattr(event, "draft_tokens", ()) or ())
            self.accepted += int(getattr(event, "num_accepted", 0) or 0)

    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None:
        pass

    def set_meta(self, key: str, value: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics:
    def __init__(self) -> None:
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first output token.",
                              TTFT_BUCKETS)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to finish.", E2E_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", ITL_BUCKETS)
        self.queue = Histogram(f"{PREFIX}_request_queue_time_seconds",
                               "Time from tokenized to first scheduled.", TTFT_BUCKETS)
        self.ttft_socket = Histogram(f"{PREFIX}_time_to_first_token_written_seconds",
                                     "Time from arrival until the first token's frame was written to the socket.",
                                     TTFT_BUCKETS)
        self.to_socket = Histogram(f"{PREFIX}_stream_ready_to_written_seconds",
                                   "Per frame: from the engine handing the (oldest) delta over to its write returning.",
                                   ITL_BUCKETS)
        self.stream_aborts: dict[str, int] = {}
        self.coalesced = 0
        self.spec = SpecCounter()
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.http_errors: dict[int, int] = {}
        self._lock = threading.Lock()

    def observe_finished(self, output: Any) -> None:
        """One finished request's timings and counts (called on the engine thread)."""
        timings = output.timings or {}
        if timings.get("ttft") is not None:
            self.ttft.observe(float(timings["ttft"]))
        for gap in timings.get("itl") or ():
            self.itl.observe(float(gap))
        if timings.get("e2e") is not None:
            self.e2e.observe(float(timings["e2e"]))
        if timings.get("tpot") is not None:
            self.tpot.observe(float(timings["tpot"]))
        if timings.get("queue") is not None:
            self.queue.observe(float(timings["queue"]))
        with self._lock:
            reason = output.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += int(output.usage.get("prompt_tokens", 0))
            self.generation_tokens += int(output.usage.get("completion_tokens", 0))

    def observe_stream(self, summary: dict[str, Any]) -> None:
        """One HTTP request's socket summary (workbench.trace.latency.socket_summary), on the event loop."""
        if summary.get("ttft_socket") is not None:
            self.ttft_socket.observe(float(summary["ttft_socket"]))
        for gap in summary.get("ready_to_written") or ():
            self.to_socket.observe(float(gap))
        with self._lock:
            self.coalesced += int(summary.get("coalesced") or 0)
            if summary.get("aborted"):
                reason = str(summary["aborted"])
                self.stream_aborts[reason] = self.stream_aborts.get(reason, 0) + 1

    def count_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self, stats: Any, dropped_events: int, step_failures: int) -> str:
        """The whole exposition; `stats` is an `EngineStats` snapshot."""
        kv_ratio = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
        rate = self.spec.accepted / self.spec.proposed if self.spec.proposed else 0.0
        lines: list[str] = []
        gauge = lambda name, help, value: lines.extend(  # noqa: E731
            [f"# HELP {PREFIX}_{name} {help}", f"# TYPE {PREFIX}_{name} gauge", f"{PREFIX}_{name} {value}"])
        counter = lambda name, help, value: lines.extend(  # noqa: E731
            [f"# HELP {PREFIX}_{name} {help}", f"# TYPE {PREFIX}_{name} counter", f"{PREFIX}_{name} {value}"])
        gauge("num_requests_running", "Requests holding KV slots.", stats.running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting)
        gauge("kv_cache_usage_ratio", "Fraction of KV token slots in use.", round(kv_ratio, 6))
        gauge("kv_cache_used_tokens", "KV token slots in use.", stats.kv_used)
        gauge("kv_cache_total_tokens", "KV token slots in the pool.", stats.kv_total)
        gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.", round(rate, 6))
        counter("spec_decode_draft_tokens_total", "Draft tokens proposed.", self.spec.proposed)
        counter("spec_decode_accepted_tokens_total", "Draft tokens accepted.", self.spec.accepted)
        counter("engine_steps_total", "Engine steps run.", stats.step)
        counter("engine_step_failures_total", "Engine steps that raised.", step_failures)
        counter("live_events_dropped_total", "Live trace events dropped for slow subscribers.", dropped_events)
        with self._lock:
            counter("prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens)
            counter("generation_tokens_total", "Output tokens of finished requests.", self.generation_tokens)
            finished, errors = dict(self.finished), dict(self.http_errors)
            aborts, coalesced = dict(self.stream_aborts), self.coalesced
        counter("stream_coalesced_deltas_total", "Deltas merged into an earlier frame because a client read slowly.",
                coalesced)
        lines += [f"# HELP {PREFIX}_stream_aborts_total Streams the server aborted, by reason.",
                  f"# TYPE {PREFIX}_stream_aborts_total counter"]
        lines += [f'{PREFIX}_stream_aborts_total{{reason="{r}"}} {n}' for r, n in sorted(aborts.items())]
        lines += [f"# HELP {PREFIX}_requests_finished_total Finished requests by finish reason.",
                  f"# TYPE {PREFIX}_requests_finished_total counter"]
        lines += [f'{PREFIX}_requests_finished_total{{finish_reason="{r}"}} {n}' for r, n in sorted(finished.items())]
        lines += [f"# HELP {PREFIX}_http_errors_total Error responses by status code.",
                  f"# TYPE {PREFIX}_http_errors_total counter"]
        lines += [f'{PREFIX}_http_errors_total{{status="{s}"}} {n}' for s, n in sorted(errors.items())]
        for hist in (self.ttft, self.itl, self.e2e, self.tpot, self.queue, self.ttft_socket, self.to_socket):
            lines += hist.render()
        return "\n".join(lines) + "\n"
