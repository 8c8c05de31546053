"""One request's latency anatomy, from queue to socket, rebuilt from its `stamp` events.

Owns the server half of the latency vocabulary and the arithmetic every viewer shares: `Handoff`
(the engine step that produced a delta, as the server received it), `ChunkTiming` (one frame the
server wrote: which deltas it carried and when it was taken, serialized and written),
`socket_summary` (the per-request summary the server emits as a `stream_end` stamp), and
`RequestLatency` (a request's stamps folded into waterfall rows, for the TUI, the notebook and
the benchmarking client). Standard library only, like the rest of `workbench.trace`.

Stamp stages: the engine emits `arrival`, `tokenized` and one `step` per step that produced tokens
(detail: start, scheduled, forward_end, sampled, output_done); the server emits `serialized` and
`written` per frame (detail: seq, the chunk's hand-off times), `aborted` (detail: reason) and one
`stream_end` (detail: `socket_summary`). All times are `time.perf_counter()` seconds: one
monotonic clock per machine, so a client on the same host can subtract them from its own.

Does not own: measuring the engine stages (workbench/engine/timing.py) or emitting anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.trace.events import Event, RequestFinished, Stamp

ENGINE_STAGES = ("tokenize", "queue", "wait", "schedule", "forward", "sample", "output")
SERVER_STAGES = ("handoff", "deliver", "serialize", "write")
# the columns of `socket_summary(...)["chunks"]`: times in seconds after arrival
CHUNK_COLUMNS = ("seq", "step", "tokens", "deltas", "bytes", "first_ready", "start", "scheduled", "forward_end",
                 "sampled", "output_done", "ready", "taken", "serialized", "written")
# waterfall segments, in the order they happen along one row
ROW_STAGES = ("schedule", "forward", "sample", "output", "buffered", "handoff", "deliver", "serialize", "write")


@dataclass(frozen=True, slots=True)
class Handoff:
    """One request's output of one engine step, as it left the engine thread (perf_counter seconds)."""

    step: int
    start: float
    scheduled: float
    forward_end: float
    sampled: float
    output_done: float  # the request's output processing ended (the engine's last hand-off)
    ready: float  # handed to the event loop
    arrival: float = 0.0  # the request's arrival (so a summary needs no finish record to time TTFT)


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """One frame written to a client: the deltas it carried (`deltas` > 1: coalesced) and its hand-offs."""

    seq: int  # the frame's index in the response (the client counts `data:` events the same way)
    tokens: int
    deltas: int
    first: Handoff  # the oldest delta in the frame
    last: Handoff  # the newest delta in the frame
    taken: float  # taken out of the server's output buffer by the serializer
    serialized: float  # the frame's bytes were handed to the socket writer
    written: float | None = None  # the write returned (None: it never did)
    bytes: int = 0

    def row(self, origin: float) -> list[float | int | None]:
        """This chunk as one row of `CHUNK_COLUMNS`, times relative to `origin`."""
        rel = (lambda t: None if t is None or not t else round(t - origin, 6))  # noqa: E731
        f, last = self.first, self.last
        return [self.seq, last.step, self.tokens, self.deltas, self.bytes, rel(f.ready), rel(last.start),
                rel(last.scheduled), rel(last.forward_end), rel(last.sampled), rel(last.output_done), rel(last.ready),
                rel(self.taken), rel(self.serialized), rel(self.written)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def socket_summary(timings: Mapping[str, Any] | None, chunks: Sequence[ChunkTiming], *, aborted: str | None = None,
                   max_pending_bytes: int = 0, received: float | None = None) -> dict[str, Any]:
    """The server's per-request summary: queue to socket.

    `timings` is the engine's `RequestOutput.timings` (None when the stream ended before the engine's
    finish record reached it, e.g. an abort: then only the socket times are given). The stages extend the engine's (which tile arrival .. its last hand-off) with the
    last chunk's server hand-offs, so they tile arrival .. the last frame written. `received` is when
    the HTTP request entered the server: `admission` (received .. arrival: reading and validating the
    body) explains most of the difference between a client's TTFT and the server's.
    """
    written = [c for c in chunks if c.written is not None]
    arrival = (timings or {}).get("arrival") or (chunks[0].first.arrival if chunks else None) or None
    out: dict[str, Any] = {
        "chunks": len(chunks), "deltas": sum(c.deltas for c in chunks),
        "coalesced": sum(c.deltas - 1 for c in chunks), "aborted": aborted, "max_pending_bytes": max_pending_bytes,
        "ready_to_written": [c.written - c.first.ready for c in written],  # queue to socket, per frame
        "itl_socket": [b.written - a.written for a, b in zip(written, written[1:])],
        "ttft_socket": None, "e2e_socket": None, "stages": None, "shares": None, "admission": None,
        "chunk_columns": list(CHUNK_COLUMNS), "chunk_rows": [],
    }
    if arrival is None:
        return out
    if received is not None:
        out["admission"] = arrival - received
    out["chunk_rows"] = [c.row(arrival) for c in chunks]
    if not written:
        return out
    out["ttft_socket"] = written[0].written - arrival
    last = written[-1]
    out["e2e_socket"] = e2e = last.written - arrival
    if not timings or not timings.get("stages"):
        return out  # aborted before the engine's finish record reached the server: no stage split
    stages = {k: float(v) for k, v in (timings.get("stages") or {}).items()}
    stages.update(handoff=last.last.ready - last.last.output_done, deliver=last.taken - last.last.ready,
                  serialize=last.serialized - last.taken, write=last.written - last.serialized)
    out["stages"] = stages
    out["shares"] = {k: (v / e2e if e2e > 0 else 0.0) for k, v in stages.items()}
    return out


@dataclass(frozen=True, slots=True)
class Segment:
    """One bar of a waterfall: a stage of one row, in seconds after the request's arrival."""

    row: int
    label: str
    stage: str
    start: float
    end: float


@dataclass(slots=True)
class RequestLatency:
    """A request's stamps and finish record, ready to draw as a waterfall (one row per engine step)."""

    req_id: str
    arrival: float | None = None
    tokenized: float | None = None
    steps: list[Stamp] = field(default_factory=list)  # stage "step", in step order
    serialized: list[Stamp] = field(default_factory=list)
    written: list[Stamp] = field(default_factory=list)
    aborted: str | None = None
    summary: dict[str, Any] | None = None  # the server's `stream_end` detail
    timings: dict[str, Any] = field(default_factory=dict)  # the engine's, from request.finished
    finish_reason: str | None = None

    @classmethod
    def from_events(cls, req_id: str, events: Iterable[Event]) -> RequestLatency:
        out = cls(req_id)
        for e in events:
            if e.req_id != req_id:
                continue
            if isinstance(e, RequestFinished):
                out.timings, out.finish_reason = dict(e.timings or {}), e.finish_reason
            elif isinstance(e, Stamp):
                out._add(e)
        if out.arrival is None and out.timings.get("arrival") is not None:
            out.arrival = float(out.timings["arrival"])
        return out

    def _add(self, e: Stamp) -> None:
        detail = e.detail or {}
        if e.stage == "arrival":
            self.arrival = e.t
        elif e.stage == "tokenized":
            self.tokenized = e.t
        elif e.stage == "step":
            self.steps.append(e)
        elif e.stage == "serialized":
            self.serialized.append(e)
        elif e.stage == "written":
            self.written.append(e)
        elif e.stage == "aborted":
            self.aborted = str(detail.get("reason", "aborted"))
        elif e.stage == "stream_end":
            self.summary = dict(detail)

    @property
    def has_server(self) -> bool:
        """True when the request went through the server (its frames were stamped)."""
        return bool(self.serialized or self.written or self.summary)

    def segments(self) -> list[Segment]:
        """The waterfall: row 0 is arrival (tokenize, queue); then one row per engine step that produced
        tokens for this request: schedule, forward, sample, output; and, for requests served over HTTP,
        the frame that carried them: buffered (coalesced behind a slow write), handoff, deliver,
        serialize, write."""
        if self.arrival is None:
            return []
        o = self.arrival
        segs: list[Segment] = []
        first_start = self.steps[0].detail.get("start") if self.steps else None
        if self.tokenized is not None:
            segs.append(Segment(0, "arrival", "tokenize", 0.0, self.tokenized - o))
            if first_start:
                segs.append(Segment(0, "arrival", "queue", self.tokenized - o, first_start - o))
        chunks = self._chunks_by_step()
        for i, stamp in enumerate(self.steps, start=1):
            d = stamp.detail
            label = f"step {stamp.step}"
            marks = [d.get("start"), d.get("scheduled"), d.get("forward_end"), d.get("sampled"), d.get("output_done")]
            segs += _bars(i, label, ROW_STAGES[:4], marks, o)
            chunk = next((c for s, c in chunks if s >= stamp.step), None)
            if chunk is None:
                continue
            if chunk["step"] != stamp.step:  # this step's delta waited for a later frame (coalesced)
                segs += _bars(i, label, ("buffered",), [d.get("output_done"), chunk["taken"]], o)
                continue
            marks = [d.get("output_done"), chunk["ready"], chunk["taken"], chunk["serialized"], chunk["written"]]
            segs += _bars(i, label, ROW_STAGES[5:], marks, o)
        return segs

    def _chunks_by_step(self) -> list[tuple[int, dict[str, Any]]]:
        """(step, hand-off times) of each stamped frame, in step order (absolute perf_counter times)."""
        written = {int(e.detail.get("seq", -1)): e.t for e in self.written}
        out = []
        for e in self.serialized:
            d = e.detail
            out.append((int(d.get("step", e.step)), {"step": int(d.get("step", e.step)), "ready": d.get("ready"),
                                                     "taken": d.get("taken"), "serialized": e.t,
                                                     "written": written.get(int(d.get("seq", -1)))}))
        return sorted(out, key=lambda x: x[0])

    def headline(self) -> dict[str, float | None]:
        """TTFT, TPOT and end-to-end (engine), and TTFT / end-to-end at the socket when served (seconds)."""
        t, s = self.timings, self.summary or {}
        return {"ttft": t.get("ttft"), "tpot": t.get("tpot"), "e2e": t.get("e2e"),
                "ttft_socket": s.get("ttft_socket"), "e2e_socket": s.get("e2e_socket")}

    def shares(self) -> dict[str, float]:
        """Share of each stage in the end-to-end time: to the socket when served, else in the engine."""
        if self.summary and self.summary.get("shares"):
            return dict(self.summary["shares"])
        return dict(self.timings.get("shares") or {})


def _bars(row: int, label: str, stages: Sequence[str], marks: Sequence[Any], origin: float) -> list[Segment]:
    out = []
    for stage, a, b in zip(stages, marks, marks[1:]):
        if a and b and b >= a:  # a missing (0 or None) hand-off draws nothing rather than a wrong bar
            out.append(Segment(row, label, stage, a - origin, b - origin))
    return out


__all__ = ["CHUNK_COLUMNS", "ENGINE_STAGES", "ROW_STAGES", "SERVER_STAGES", "ChunkTiming", "Handoff",
           "RequestLatency", "Segment", "percentile", "socket_summary"]
