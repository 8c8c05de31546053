"""Every trace event kind, as typed frozen records (the schema of a `.wbtrace` file).

This module owns the event vocabulary shared by the engine (which emits), the store (which writes),
the reader, replay, diff, export and every viewer (which read). It imports only the standard
library. Each record has a `kind`, the engine `step` it belongs to, the `req_id` it concerns (None
for batch-level events), a monotonic time `t` (seconds, `time.perf_counter()`), and payload fields.

JSON form (lossless): `{"kind": ..., "step": ..., "req_id": ..., "t": ..., "payload": {...}}`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

# 2: a sampling stage that changed nothing is stored as {"name", "applied": false, "repeat": true}
# 3: a run of one step's events of one kind about different requests may share one row (format.py);
#    a forward_batch's layers that run the same attention are stored once with a count (LAYER_RUNS)
SCHEMA_VERSION = 3
LAYER_RUNS = "@layer_runs"  # the payload key of those counts (no field has this name)
MAX_LAYERS = 65536  # what a stored forward_batch's counts may expand to

# Trace levels. `off` records nothing and costs nothing; `summary` records every event below;
# `full` adds full tensors (logits vectors) to the tensors table.
LEVELS = ("off", "summary", "full")


def level_value(level: str) -> int:
    """Map a level name to its rank (off=0, summary=1, full=2); ValueError names the allowed set."""
    if level not in LEVELS:
        raise ValueError(f"trace_level must be one of {LEVELS}, got {level!r}")
    return LEVELS.index(level)


_PAYLOAD_FIELDS: dict[type, tuple[str, ...]] = {}  # per event class, the fields its payload holds
_NONE_DEFAULTS: dict[type, tuple[str, ...]] = {}  # per event class, its payload fields that default to None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every trace record: kind, step, request and monotonic time."""

    kind: ClassVar[str] = "event"
    step: int
    req_id: str | None = None
    t: float = 0.0

    def payload(self) -> dict[str, Any]:
        names = _PAYLOAD_FIELDS.get(type(self))
        if names is None:  # once per class: dataclasses.fields was a fifth of a trace writer's time
            names = _PAYLOAD_FIELDS[type(self)] = tuple(
                f.name for f in dataclasses.fields(self) if f.name not in ("step", "req_id", "t"))
        return {name: getattr(self, name) for name in names}

    def stored_payload(self) -> dict[str, Any]:
        """The payload as a trace file keeps it: a field holding None whose default is None is left
        out (`event_from_json` fills the default in again), so that most events' JSON holds no null
        and the writer's encoder need not tell a None from a NaN in it (format.json_dumps)."""
        out = self.payload()
        names = _NONE_DEFAULTS.get(type(self))
        if names is None:
            names = _NONE_DEFAULTS[type(self)] = tuple(
                f.name for f in dataclasses.fields(self)
                if f.name not in ("step", "req_id", "t") and f.default is None)
        for name in names:
            if name in out and out[name] is None:
                del out[name]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "req_id": self.req_id, "t": self.t,
                "payload": self.payload()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=True)


# --- request lifecycle -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestAdded(Event):
    """A request entered the engine: its prompt, prompt token ids and sampling parameters."""

    kind: ClassVar[str] = "request.added"
    prompt: Any = None  # the text, or the chat as a list of {"role", "content"}
    prompt_ids: list[int] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None  # for n > 1: the request whose prompt this one shares


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    """A request left the engine: final text, finish reason with evidence, usage and timings."""

    kind: ClassVar[str] = "request.finished"
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: Any = None
    evidence: dict[str, Any] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] | None = None  # speculative-decoding metrics of this request
    error: str | None = None


# --- scheduling and memory -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleDecision(Event):
    """What the scheduler chose this step: queues, prefill chunks, decodes, preemptions, budget."""

    kind: ClassVar[str] = "schedule"
    mode: str = "IDLE"
    waiting: list[str] = field(default_factory=list)  # still waiting after this decision
    running: list[str] = field(default_factory=list)  # every request holding KV after this decision
    prefill: list[dict[str, Any]] = field(default_factory=list)  # {req_id, start, length, last_chunk}
    decode: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {req_id, reason}
    token_budget: int = 0
    tokens_scheduled: int = 0
    kv_used: int = 0
    kv_total: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEvent(Event):
    """An explicit KV-slot operation: allocate, free (finish/abort/preempt), spec rollback, or the
    prefix cache keeping a finished request's slots (cache) and freeing them again (evict). `kv_used`
    is the pool's occupancy after the operation."""

    kind: ClassVar[str] = "kv"
    op: str = "alloc"  # alloc | free | rollback | cache | evict
    slots: list[int] = field(default_factory=list)
    reason: str = ""
    kv_used: int = 0
    kv_total: int = 0


# --- forward ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardBatchBuilt(Event):
    """The ForwardBatch handed to the ModelRunner, with every field and each request's slice."""

    kind: ClassVar[str] = "forward_batch"
    forward_mode: str = "IDLE"
    batch_size: int = 0
    input_ids: list[int] = field(default_factory=list)
    req_pool_indices: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    out_cache_loc: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    extend_prefix_lens: list[int] = field(default_factory=list)
    extend_seq_lens: list[int] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    sampling_info: list[dict[str, Any]] = field(default_factory=list)  # per request, compact
    model: str = "target"  # target | draft (a drafter's forward in speculative decoding)
    # per layer, the attention it runs: {window (None = full), softcap, sinks, scaling}; [] in older files
    attention: list[dict[str, Any]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        # Consecutive layers holding the very same record (engine/run/variants.trace_record shares it
        # between layers that run the same attention: every layer of most models) are stored once,
        # with their count under LAYER_RUNS; decoding restores one entry a layer.
        out = Event.payload(self)
        attention, counts = [], []
        for layer in self.attention:
            if attention and layer is attention[-1]:
                counts[-1] += 1
            else:
                attention.append(layer)
                counts.append(1)
        if len(attention) < len(self.attention):
            out["attention"], out[LAYER_RUNS] = attention, counts
        return out

    @staticmethod
    def expand_payload(payload: dict[str, Any]) -> dict[str, Any]:
        counts = payload.get(LAYER_RUNS)
        if counts is None:
            return payload
        attention = payload.get("attention")
        if not (isinstance(counts, list) and isinstance(attention, list) and len(counts) == len(attention)
                and all(type(c) is int and c >= 1 for c in counts) and sum(counts) <= MAX_LAYERS):
            raise ValueError(f"forward_batch: a malformed {LAYER_RUNS} (counts of 1 or more, one per "
                             f"attention entry, at most {MAX_LAYERS} layers in all)")
        out = {k: v for k, v in payload.items() if k != LAYER_RUNS}
        out["attention"] = [layer for layer, n in zip(attention, counts) for _ in range(n)]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardDone(Event):
    """The model forward finished: its mode, size and wall time in milliseconds."""

    kind: ClassVar[str] = "forward"
    forward_mode: str = "IDLE"
    num_tokens: int = 0
    batch_size: int = 0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    model: str = "target"  # target | draft


@dataclass(frozen=True, slots=True, kw_only=True)
class Logits(Event):
    """Summary of one request's logits row: top-k ids and values, entropy, max, and the tensor name at level full."""

    kind: ClassVar[str] = "logits"
    position: int = 0  # output index of the token these logits choose
    top_ids: list[int] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    entropy: float = 0.0
    tensor: str | None = None


class RepeatedStage(dict):
    """A stage record made from the record before it by `of` (a stage that changed no row):
    `SamplingStages.payload` knows it by its `source` without comparing the two (a fifth of a
    traced batch step's writing). Otherwise a plain dict."""

    __slots__ = ("source",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source: dict[str, Any] | None = None

    @classmethod
    def of(cls, source: dict[str, Any], name: str) -> RepeatedStage:
        """`{**source, "name": name, "kept_mass": 1.0, "applied": False}`, knowing its source."""
        out = cls.__new__(cls)  # without __init__'s keyword pass: 0.5 us against 1.9, 7 a traced row a step
        out.update(source)
        out["name"], out["kept_mass"], out["applied"] = name, 1.0, False
        out.source = source
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingStages(Event):
    """The distribution after every sampling stage for one request: top-k probs, kept mass, chosen token and draw."""

    kind: ClassVar[str] = "sampling"
    position: int = 0
    # each stage: {"name", "top_ids", "top_probs", "kept_mass", "kept_count", "entropy", "applied"}
    stages: list[dict[str, Any]] = field(default_factory=list)
    chosen: int = -1
    greedy: bool = True
    draw: float | None = None  # the uniform draw used by the sampler (None for greedy)
    seeded: bool = False

    def payload(self) -> dict[str, Any]:
        # A stage that applied to no row repeats the record before it with all mass kept; on disk
        # it is only named (most stages of most rows), and decoding restores the full record.
        out = Event.payload(self)
        stages, prev = [], None
        for s in self.stages:
            if prev is not None and ((type(s) is RepeatedStage and s.source is prev) or (
                    s.get("applied") is False and s.get("kept_mass") == 1.0
                    and s == {**prev, "name": s.get("name"), "kept_mass": 1.0, "applied": False})):
                stages.append({"name": s["name"], "applied": False, "repeat": True})
            else:
                stages.append(s)
            prev = s
        out["stages"] = stages
        return out

    @staticmethod
    def expand_payload(payload: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(payload.get("stages"), list):
            return payload
        stages, prev = [], None
        for s in payload["stages"]:
            if isinstance(s, dict) and s.get("repeat") is True:
                if prev is None:
                    raise ValueError("sampling stages: the first stage cannot repeat a previous one")
                s = {**prev, "name": s.get("name"), "kept_mass": 1.0, "applied": False}
            stages.append(s)
            prev = s
        return {**payload, "stages": stages}


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenChosen(Event):
    """A token appended to a request's output: id, text, logprob, rank and the top alternatives."""

    kind: ClassVar[str] = "token"
    position: int = 0
    token_id: int = -1
    text: str = ""
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[list[Any]] = field(default_factory=list)  # [[token_id, logprob, text], ...]
    source: str = "sample"  # sample | forced | spec_accept | spec_recover | spec_bonus


# --- speculative decoding --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecDraft(Event):
    """Draft tokens proposed for one request, with the drafter's probability q of each."""

    kind: ClassVar[str] = "spec.draft"
    drafter: str = ""
    tokens: list[int] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    position: int = 0  # output index the first draft token would take


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecVerify(Event):
    """Verification of one request's drafts: p, q, u and accept/reject per position, the extra token, freed slots."""

    kind: ClassVar[str] = "spec.verify"
    draft_tokens: list[int] = field(default_factory=list)
    p: list[float] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    u: list[float | None] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    num_accepted: int = 0
    extra_token: int | None = None
    extra_kind: str = ""  # recovered | bonus | target (greedy)
    target_argmax: list[int] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)
    greedy: bool = True
    position: int = 0  # output index of the first draft token
    emitted: list[int] = field(default_factory=list)  # tokens appended (cut at a stop or max_new_tokens)
    extra_draw: float | None = None  # the uniform that drew the recovered or bonus token
    draft_freed_slots: list[int] = field(default_factory=list)  # draft model KV slots rolled back


# --- output processing -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokState(Event):
    """The incremental detokenizer after this step: new ids, offsets, held-back text and why, emitted delta."""

    kind: ClassVar[str] = "detok"
    new_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    decoded_len: int = 0
    held_text: str = ""
    held_reason: str | None = None  # None | incomplete_char | possible_stop
    delta: str = ""
    stop_matched: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishDecision(Event):
    """Every finish check made for one request this step, in order, with inputs and result."""

    kind: ClassVar[str] = "finish"
    # each check: {"name", "inputs", "result"}; result True means the check fired
    checks: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    evidence: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stamp(Event):
    """A latency hand-off of one request on the engine's monotonic clock (arrival, tokenized, sampled, ...)."""

    kind: ClassVar[str] = "stamp"
    stage: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineError(Event):
    """A failure inside a step, with the requests it ended."""

    kind: ClassVar[str] = "error"
    message: str = ""
    affected: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Captured(Event):
    """Inside the forward that chose output `position`: the tensors kept for it (names in the tensors
    table, by quantity: hidden, norms, lens_*, attention_*), the chosen token, the positions attended
    (`kv_len`), the top-2 probability margin of the sampler's logits, per residual entry
    (embeddings, then each layer) the logit lens's top token texts, and on a request's first capture
    its prompt's token texts (what attended positions point at)."""

    kind: ClassVar[str] = "capture"
    position: int = 0
    token_id: int = 0
    kv_len: int = 0
    margin: float | None = None
    what: list[str] = field(default_factory=list)
    tensors: dict[str, Any] = field(default_factory=dict)
    lens_texts: list[list[Any]] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)  # the prompt's token texts, on a request's first capture


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RequestAdded, RequestFinished, ScheduleDecision, KVEvent, ForwardBatchBuilt, ForwardDone,
        Logits, SamplingStages, TokenChosen, SpecDraft, SpecVerify, DetokState, FinishDecision,
        Stamp, EngineError, Captured,
    )
}


def event_from_json(obj: dict[str, Any]) -> Event:
    """Rebuild a typed event from its JSON form; unknown kinds or fields raise ValueError."""
    try:
        cls = EVENT_TYPES[obj["kind"]]
    except KeyError as exc:
        raise ValueError(f"unknown event kind {obj.get('kind')!r}") from exc
    payload = obj.get("payload") or {}
    expand = getattr(cls, "expand_payload", None)
    if expand is not None:  # first: a stored form may hold keys of its own (LAYER_RUNS)
        payload = expand(payload)
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(payload) - names
    if extra:
        raise ValueError(f"event kind {cls.kind!r} has no fields {sorted(extra)}")
    return cls(step=int(obj["step"]), req_id=obj.get("req_id"), t=float(obj.get("t", 0.0)), **payload)


def event_loads(text: str) -> Event:
    return event_from_json(json.loads(text))
