"""Prometheus metrics, exposed through prometheus_client (text format or OpenMetrics, escaping done there).

Owns: latency histograms (TTFT, TPOT, inter-token latency, queue time, end-to-end), request and
token counters fed by finished requests (`observe_finished`, called on the engine thread), stream
metrics fed by each HTTP request's socket summary (`observe_stream`, on the event loop: engine
hand-off to socket write per frame, time to the first byte written, aborts by reason, coalesced
deltas), speculative-decoding
draft/accept counters fed by trace events (`SpecCounter`, a tracer sink), and rendering everything
with the engine gauges (running, waiting, KV usage) at scrape time, under the project's names
(`workbench_*`) and vLLM's (`vllm:*`, labelled with `model_name`). Does not own: the gauges'
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

    def family(self, name: str, help: str, labels: dict[str, str] | None = None) -> Any:
        """This histogram as a prometheus_client metric family named `name`."""
        from prometheus_client.core import HistogramMetricFamily

        with self._lock:
            counts, total = list(self.counts), self.sum
        cum, buckets = 0, []
        for bound, c in zip([*map(str, self.buckets), "+Inf"], counts):
            cum += c
            buckets.append((bound, cum))
        fam = HistogramMetricFamily(name, help, labels=list(labels or ()))
        fam.add_metric(list((labels or {}).values()), buckets, total)
        return fam


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

    def render(self, stats: Any, dropped_events: int, step_failures: int, *, model_name: str = "workbench",
               openmetrics: bool = False, grammar: dict[str, Any] | None = None) -> str:
        """The whole exposition (`stats` is an `EngineStats` snapshot), through prometheus_client: the
        Prometheus text format, or OpenMetrics when the scraper asks for it."""
        from prometheus_client import CollectorRegistry, exposition
        from prometheus_client.openmetrics import exposition as om

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self, stats, dropped_events, step_failures, model_name, grammar))
        return (om.generate_latest(registry) if openmetrics else exposition.generate_latest(registry)).decode()

    def families(self, stats: Any, dropped_events: int, step_failures: int, model_name: str) -> list[Any]:
        """Every metric family: the project's own (`workbench_*`) and vLLM's names (`vllm:*`, label model_name)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kv_ratio = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
        rate = self.spec.accepted / self.spec.proposed if self.spec.proposed else 0.0
        with self._lock:
            prompt, generation = self.prompt_tokens, self.generation_tokens
            finished, errors = dict(self.finished), dict(self.http_errors)
            aborts, coalesced = dict(self.stream_aborts), self.coalesced
        out: list[Any] = []

        def own(kind: type, name: str, help: str, value: float) -> None:
            out.append(kind(f"{PREFIX}_{name}", help, value=value))

        def labelled(kind: type, name: str, help: str, label: str, values: dict[Any, int]) -> None:
            fam = kind(name, help, labels=[label])
            for key, n in sorted(values.items()):
                fam.add_metric([str(key)], n)
            out.append(fam)

        own(GaugeMetricFamily, "num_requests_running", "Requests holding KV slots.", stats.running)
        own(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting)
        own(GaugeMetricFamily, "kv_cache_usage_ratio", "Fraction of KV token slots in use.", round(kv_ratio, 6))
        own(GaugeMetricFamily, "kv_cache_used_tokens", "KV token slots in use.", stats.kv_used)
        own(GaugeMetricFamily, "kv_cache_total_tokens", "KV token slots in the pool.", stats.kv_total)
        own(GaugeMetricFamily, "spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
            round(rate, 6))
        own(CounterMetricFamily, "spec_decode_draft_tokens", "Draft tokens proposed.", self.spec.proposed)
        own(CounterMetricFamily, "spec_decode_accepted_tokens", "Draft tokens accepted.", self.spec.accepted)
        own(CounterMetricFamily, "engine_steps", "Engine steps run.", stats.step)
        own(CounterMetricFamily, "engine_step_failures", "Engine steps that raised.", step_failures)
        own(CounterMetricFamily, "live_events_dropped", "Live trace events dropped for slow subscribers.",
            dropped_events)
        own(CounterMetricFamily, "prompt_tokens", "Prompt tokens of finished requests.", prompt)
        own(CounterMetricFamily, "generation_tokens", "Output tokens of finished requests.", generation)
        own(CounterMetricFamily, "stream_coalesced_deltas",
            "Deltas merged into an earlier frame because a client read slowly.", coalesced)
        labelled(CounterMetricFamily, f"{PREFIX}_stream_aborts", "Streams the server aborted, by reason.", "reason",
                 aborts)
        labelled(CounterMetricFamily, f"{PREFIX}_requests_finished", "Finished requests by finish reason.",
                 "finish_reason", finished)
        labelled(CounterMetricFamily, f"{PREFIX}_http_errors", "Error responses by status code.", "status", errors)
        out += [h.family(h.name, h.help) for h in (self.ttft, self.itl, self.e2e, self.tpot, self.queue,
                                                   self.ttft_socket, self.to_socket)]
        out += _vllm_families(self, stats, kv_ratio, prompt, generation, finished, model_name)
        return out


def _vllm_families(m: Metrics, stats: Any, kv_ratio: float, prompt: int, generation: int,
                   finished: dict[str, int], model: str) -> list[Any]:
    """The same numbers under vLLM's names, so a vLLM Grafana dashboard reads this server unchanged."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: list[Any] = []

    def one(kind: type, name: str, help: str, value: float) -> None:
        fam = kind(f"vllm:{name}", help, labels=["model_name"])
        fam.add_metric([model], value)
        out.append(fam)

    one(GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.", stats.running)
    one(GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
    one(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", round(kv_ratio, 6))
    one(CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed.", prompt)
    one(CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.", generation)
    one(CounterMetricFamily, "spec_decode_num_draft_tokens", "Number of draft tokens.", m.spec.proposed)
    one(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Number of accepted tokens.", m.spec.accepted)
    success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                  labels=["model_name", "finished_reason"])
    for reason, n in sorted(finished.items()):
        success.add_metric([model, reason], n)
    out.append(success)
    for hist, name in ((m.ttft, "time_to_first_token_seconds"), (m.itl, "inter_token_latency_seconds"),
                       (m.tpot, "time_per_output_token_seconds"), (m.e2e, "e2e_request_latency_seconds"),
                       (m.queue, "request_queue_time_seconds")):
        out.append(hist.family(f"vllm:{name}", hist.help, {"model_name": model}))
    return out


class _Snapshot:
    """A prometheus_client collector over one scrape's values."""

    def __init__(self, metrics: Metrics, stats: Any, dropped: int, failures: int, model_name: str,
                 grammar: dict[str, Any] | None = None) -> None:
        self.args = (metrics, stats, dropped, failures, model_name)
        self.grammar = grammar

    def collect(self) -> Any:
        metrics, *rest = self.args
        yield from metrics.families(*rest)
        if self.grammar is not None:
            yield from grammar_families(self.grammar)


def grammar_families(status: dict[str, Any]) -> list[Any]:
    """Structured output's state (`GrammarBackend.status()`): worker processes started and when the
    newest became ready (0 until one did), and compiles by kind, in the worker and in this process."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    started = CounterMetricFamily(f"{PREFIX}_grammar_workers_started", "Grammar worker processes started.",
                                  value=status.get("workers_started", 0))
    ready = GaugeMetricFamily(f"{PREFIX}_grammar_worker_ready_time_seconds",
                              "Unix time the newest grammar worker became ready (0: none yet).",
                              value=status.get("worker_ready_at") or 0.0)
    compiler = GaugeMetricFamily(f"{PREFIX}_grammar_compiler_ready_time_seconds",
                                 "Unix time xgrammar and the tokenizer's info were ready in the server (0: not yet).",
                                 value=status.get("compiler_ready_at") or 0.0)
    compiles = CounterMetricFamily(f"{PREFIX}_grammar_compiles", "Constraints compiled, by where and kind.",
                                   labels=["where", "kind"])
    for where, key in (("worker", "worker_runs"), ("server", "compiles")):
        for kind, n in sorted((status.get(key) or {}).items()):
            compiles.add_metric([where, kind], n)
    return [started, ready, compiler, compiles]
