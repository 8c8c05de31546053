"""The event schema's JSON form and the `.wbtrace` writer: lossless round trips, step summaries,
crash safety (SIGKILL mid-run), and a writer that never takes the engine down."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.trace import events as ev
from workbench.trace.reader import TraceError, open_trace
from workbench.trace.store import TraceWriter
from workbench.trace.synth import example_events

ROOT = Path(__file__).resolve().parents[2]

# --- hypothesis strategies: every field type the schema uses --------------------------------------

_floats = st.floats(allow_nan=False, allow_infinity=False)
_text = st.text(max_size=12)
_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | _floats | _text
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(_text, c, max_size=4),
                     max_leaves=6)
_json_dict = st.dictionaries(_text, _json, max_size=4)
FIELD_STRATEGIES = {
    "Any": _json, "bool": st.booleans(), "int": st.integers(-(2**40), 2**40), "float": _floats, "str": _text,
    "int | None": st.none() | st.integers(), "float | None": st.none() | _floats, "str | None": st.none() | _text,
    "dict[str, Any]": _json_dict, "dict[str, Any] | None": st.none() | _json_dict,
    "dict[str, int]": st.dictionaries(_text, st.integers(), max_size=4),
    "list[int]": st.lists(st.integers(0, 2**31), max_size=8), "list[float]": st.lists(_floats, max_size=8),
    "list[float | None]": st.lists(st.none() | _floats, max_size=8), "list[bool]": st.lists(st.booleans(), max_size=8),
    "list[str]": st.lists(_text, max_size=6), "list[dict[str, Any]]": st.lists(_json_dict, max_size=3),
    "list[list[Any]]": st.lists(st.lists(_json, max_size=3), max_size=3),
}


def event_strategy(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    fields = {f.name: FIELD_STRATEGIES[f.type] for f in dataclasses.fields(cls) if f.name not in ("step", "req_id", "t")}
    return st.builds(cls, step=st.integers(0, 10_000), req_id=st.none() | _text, t=_floats, **fields)


any_event = st.one_of([event_strategy(cls) for cls in ev.EVENT_TYPES.values()])


def test_every_field_type_has_a_strategy() -> None:
    # a new field type in events.py must get a strategy here, or the round trips below skip it
    types = {f.type for cls in ev.EVENT_TYPES.values() for f in dataclasses.fields(cls)}
    assert types - {"int", "str | None", "float"} <= set(FIELD_STRATEGIES)


@pytest.mark.parametrize("kind", sorted(ev.EVENT_TYPES))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_every_kind_round_trips_through_json(kind: str, data: st.DataObject) -> None:
    event = data.draw(event_strategy(ev.EVENT_TYPES[kind]))
    assert ev.event_loads(event.dumps()) == event


def test_nan_and_infinity_round_trip_through_json() -> None:
    event = ev.TokenChosen(step=1, req_id="r", t=0.5, logprob=float("-inf"), top_logprobs=[[1, float("nan"), "x"]])
    back = ev.event_loads(event.dumps())
    assert back.logprob == float("-inf") and math.isnan(back.top_logprobs[0][1])


_any_float = st.floats() | st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0])
_hostile = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _any_float | st.text(max_size=6)
    | st.sampled_from(["null", "NaN", "\ud800"]),
    lambda c: st.lists(c, max_size=4) | st.tuples(c, c) | st.dictionaries(st.text(max_size=4) | st.integers(), c,
                                                                          max_size=4), max_leaves=12)


def _same_json_value(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(_hostile)
def test_the_fast_encoder_reads_back_as_the_standard_library_does(value: object) -> None:
    # the trace writer's encoder (orjson where it is safe) against json.dumps(allow_nan=True): a NaN
    # or infinity must stay one after a round trip, not become the null orjson writes for it
    import json

    from workbench.trace.format import json_dumps

    assert _same_json_value(json.loads(json_dumps(value)), json.loads(json.dumps(value, allow_nan=True)))


def test_a_nan_logit_in_a_written_trace_reads_back_as_nan(tmp_path: Path) -> None:
    path = tmp_path / "nan.wbtrace"
    events = [ev.Logits(step=1, req_id="r", t=0.5, position=0, top_ids=[3, 4], top_logits=[float("nan"), 1.0],
                        entropy=float("inf"), tensor=None),
              ev.TokenChosen(step=1, req_id="r", t=0.5, position=0, token_id=3, text="x", logprob=None,
                             top_logprobs=[[3, float("-inf"), "x"], [4, 0.0, None]])]
    with TraceWriter(path) as writer:
        for event in events:
            writer.write(event)
    with open_trace(path) as trace:
        logits, token = trace.events()
    assert math.isnan(logits.top_logits[0]) and logits.entropy == float("inf") and logits.tensor is None
    assert token.logprob is None and token.top_logprobs == [[3, float("-inf"), "x"], [4, 0.0, None]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_event, min_size=1, max_size=20))
def test_events_round_trip_through_a_trace_file(events: list[ev.Event]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.wbtrace"
        with TraceWriter(path, {"note": "hypothesis"}) as writer:
            for event in events:
                writer.write(event)
        with open_trace(path) as trace:
            expected = sorted(events, key=lambda e: e.step)  # stable: emission order within a step
            assert list(trace.events()) == expected
            for step in {e.step for e in events}:
                assert trace.step(step) == [e for e in events if e.step == step]
            assert trace.num_events == len(events)


def test_meta_tensors_and_finished_flag(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    writer = TraceWriter(path, {"model": {"name": "tiny", "hash": "abc"}, "seeds": [1, 2]})
    logits = np.linspace(-3, 3, 10, dtype=np.float32)
    writer.write_tensor("logits/0/r1", 0, "r1", logits)
    logits[:] = 0  # the engine may reuse its buffer at once: the writer copied it
    writer.write_tensor("hidden/0/r1", 0, "r1", np.arange(6, dtype=np.float16).reshape(2, 3))
    writer.set_meta("requests", [{"req_id": "r1", "arrival_step": 0}])
    writer.set_meta("engine", {"config": np.int64(3)})  # numpy values are stored as plain JSON
    writer.flush()
    with open_trace(path) as live:
        assert live.finished is False
        assert live.meta["model"] == {"name": "tiny", "hash": "abc"}
        assert live.meta["engine"] == {"config": 3}
    writer.close()
    with open_trace(path) as trace:
        assert trace.finished is True and trace.meta["format"] == "wbtrace"
        assert trace.meta["requests"] == [{"req_id": "r1", "arrival_step": 0}]
        assert trace.tensor_names(step=0) == ["hidden/0/r1", "logits/0/r1"]
        np.testing.assert_array_equal(trace.tensor("logits/0/r1"), np.linspace(-3, 3, 10, dtype=np.float32))
        hidden = trace.tensor("hidden/0/r1")
        assert hidden.dtype == np.float16 and hidden.shape == (2, 3)
        with pytest.raises(KeyError):
            trace.tensor("nope")
    assert sorted(os.listdir(tmp_path)) == ["run.wbtrace"]  # closed: one self-contained file


def test_step_summaries_follow_schedule_forward_and_spec_events(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    with TraceWriter(path) as writer:
        for event in example_events(step=0, req_id="a"):
            writer.write(event)
        writer.write(ev.ScheduleDecision(step=1, t=2.0, mode="DECODE", decode=["a"], kv_used=5, kv_total=64))
        writer.write(ev.ForwardDone(step=1, t=2.1, forward_mode="DRAFT_EXTEND", batch_size=1, num_tokens=2,
                                    forward_ms=1.0, model="draft"))
        writer.write(ev.ForwardDone(step=1, t=2.2, forward_mode="TARGET_VERIFY", batch_size=1, num_tokens=3,
                                    forward_ms=4.0))
        writer.write(ev.SpecVerify(step=1, req_id="a", t=2.3, draft_tokens=[1, 2, 3], num_accepted=2))
        writer.write(ev.KVEvent(step=1, t=2.4, op="rollback", slots=[9], kv_used=4, kv_total=64))
    with open_trace(path) as trace:
        first, second = trace.steps()
        assert trace.last_complete_step == 1  # finished: every step is complete
    assert (first.mode, first.batch_size, first.num_tokens, first.req_ids) == ("EXTEND", 1, 3, ("a",))
    assert (first.output_tokens, first.num_events, first.forward_ms) == (1, 15, 2.5)
    assert (second.mode, second.num_tokens, second.forward_ms) == ("DECODE", 3, 5.0)
    assert (second.spec_proposed, second.spec_accepted, second.kv_used, second.kv_total) == (3, 2, 4, 64)
    assert second.req_ids == ("a",) and (second.t_start, second.t_end) == (2.0, 2.4)


def test_the_last_steps_events_reach_the_file_without_a_flush() -> None:
    # An engine that goes idle after a step calls no flush, and a live reader of the file must still
    # see that step: the writer commits what it holds without being asked (within about 0.1 s).
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "idle.wbtrace"
        writer = TraceWriter(path)
        try:
            for step in (1, 2):
                writer.write(ev.ScheduleDecision(step=step, t=float(step), mode="DECODE", decode=["a"]))
                writer.write(ev.TokenChosen(step=step, req_id="a", t=float(step), position=step, token_id=step))
            deadline = time.monotonic() + 5.0
            seen: list[int] = []
            while time.monotonic() < deadline:
                with sqlite3.connect(path) as conn:
                    seen = [row[0] for row in conn.execute("SELECT DISTINCT step FROM events ORDER BY step")]
                if seen == [1, 2]:
                    break
                time.sleep(0.05)
            assert seen == [1, 2], f"steps in the file without a flush: {seen}"
            assert time.monotonic() < deadline
        finally:
            writer.close()


def test_writer_replaces_an_old_file_and_refuses_writes_after_close(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    path.write_text("an old file")
    writer = TraceWriter(path)
    writer.write(ev.Stamp(step=0, req_id="r", stage="arrival"))
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        writer.write(ev.Stamp(step=1, req_id="r"))
    with open_trace(path) as trace:
        assert trace.num_events == 1


def test_a_broken_disk_stops_the_writer_but_not_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    writer = TraceWriter(path)
    writer._conn.execute("DROP TABLE events")  # simulate a write that fails inside the writer thread
    writer.write(ev.Stamp(step=0, req_id="r"))
    with pytest.raises(RuntimeError, match="trace writer .* failed"):
        writer.flush()
    writer.write(ev.Stamp(step=1, req_id="r"))  # still only enqueues: never raises into the engine loop
    with pytest.raises(RuntimeError):
        writer.close()


def test_a_malformed_event_or_tensor_is_dropped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    with TraceWriter(path) as writer:
        writer.write(ev.Stamp(step="not a step", req_id="r"))  # type: ignore[arg-type]
        writer.write(ev.Stamp(step=2**70, req_id="r"))
        writer.write_tensor("bad", 0, None, object())  # safetensors cannot store an object array
        writer.write(ev.Stamp(step=1, req_id="r", t=float("nan"), stage="ok"))
    assert writer.dropped == 3
    with open_trace(path) as trace:
        assert [e.stage for e in trace.events()] == ["ok"] and trace.tensor_names() == []
        assert trace.meta["dropped"]["count"] == 3 and "bad" in trace.meta["dropped"]["last_error"]


CHILD = textwrap.dedent("""
    import sys, time
    from workbench.trace import events as ev
    from workbench.trace.store import TraceWriter
    writer = TraceWriter(sys.argv[1], {"run": "killed"})
    step = 0
    while True:
        writer.write(ev.ScheduleDecision(step=step, t=time.perf_counter(), mode="DECODE", decode=["a", "b"]))
        for rid in ("a", "b"):
            writer.write(ev.TokenChosen(step=step, req_id=rid, t=time.perf_counter(), position=step,
                                        token_id=step, text=f"<{step}>"))
        if step % 3 == 2:
            writer.flush()
            print(step, flush=True)  # every step up to here is committed
        step += 1
""")


def test_sigkill_mid_run_leaves_every_committed_step(tmp_path: Path) -> None:
    path = tmp_path / "killed.wbtrace"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        flushed = -1
        while flushed < 60:
            line = child.stdout.readline()
            assert line, "the recording child died before flushing 60 steps"
            flushed = int(line)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    with open_trace(path) as trace:
        assert not trace.finished and trace.meta["run"] == "killed"
        steps = trace.steps()
        assert trace.last_complete_step == steps[-2].step >= flushed - 1
        assert len(steps) >= flushed + 1
        for info in steps:  # summaries and events were committed together: always consistent
            assert info.num_events == len(trace.step(info.step))
        for step in range(flushed + 1):
            events = trace.step(step)
            assert [e.kind for e in events] == ["schedule", "token", "token"]
            assert [e.text for e in events[1:]] == [f"<{step}>"] * 2
        trace.check()


def test_reading_never_modifies_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    with TraceWriter(path) as writer:
        for event in example_events():
            writer.write(event)
    before = path.read_bytes()
    with open_trace(path) as trace:
        list(trace.events())
        trace.requests()
        trace.tokens_frame()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["run.wbtrace"]
    with pytest.raises(sqlite3.OperationalError):  # and the reader's connection could not have written
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.execute("INSERT INTO meta VALUES ('x', '1')")


def test_unchanged_sampling_stages_are_stored_once_and_read_back_whole(tmp_path: Path) -> None:
    logits = {"name": "logits", "top_ids": [5, 7], "top_probs": [0.6, 0.3], "kept_mass": 1.0, "kept_count": 40,
              "entropy": 1.1, "applied": True}
    top_k = {**logits, "name": "top_k", "top_probs": [0.66, 0.34], "kept_count": 2, "kept_mass": 0.9}
    stages = [logits, {**logits, "name": "penalties", "applied": False}, top_k,
              {**top_k, "name": "top_p", "applied": False, "kept_mass": 1.0}]
    event = ev.SamplingStages(step=1, req_id="r", t=1.0, position=0, stages=stages, chosen=5)
    path = tmp_path / "s.wbtrace"
    with TraceWriter(path) as w:
        w.write(event)
    stored = sqlite3.connect(path).execute("SELECT payload FROM events").fetchone()[0]
    assert stored.count("top_ids") == 2 and stored.count('"repeat":true') == 2
    assert list(open_trace(path).events(kind="sampling")) == [event]


def test_fields_left_at_none_are_not_stored_and_read_back_as_none(tmp_path: Path) -> None:
    # A greedy row's draw, a summary's logits tensor, a running request's finish reason: None, so a
    # file leaves them out (less to encode, and no null for the encoder to tell from a NaN); reading
    # restores them. A None nested in a value is kept as it is.
    events = [ev.SamplingStages(step=1, req_id="a", t=1.0, position=0, chosen=5, draw=None),
              ev.Logits(step=1, req_id="a", t=1.0, top_ids=[5], top_logits=[2.5], entropy=0.5, tensor=None),
              ev.FinishDecision(step=1, req_id="a", t=1.0, checks=[{"name": "abort", "inputs": {"reason": None},
                                                                   "result": False}]),
              ev.SamplingStages(step=2, req_id="a", t=2.0, position=1, chosen=3, draw=0.25, greedy=False)]
    path = tmp_path / "n.wbtrace"
    with TraceWriter(path) as w:
        for event in events:
            w.write(event)
    stored = [row[0] for row in sqlite3.connect(path).execute("SELECT payload FROM events ORDER BY id")]
    assert '"draw"' not in stored[0] and '"tensor"' not in stored[1] and '"finish_reason"' not in stored[2]
    assert '"reason":null' in stored[2] and '"draw":0.25' in stored[3]
    assert list(open_trace(path).events()) == events


def test_a_stage_made_from_the_one_before_is_named_only_and_one_moved_is_stored_whole(tmp_path: Path) -> None:
    logits = {"name": "logits", "top_ids": [5, 7], "top_probs": [0.6, 0.3], "kept_mass": 1.0, "kept_count": 40,
              "entropy": 1.1, "applied": True}
    repeat = ev.RepeatedStage.of(logits, "penalties")  # how the sampler records a stage that changed nothing
    moved = ev.RepeatedStage.of({**logits, "entropy": 2.0}, "top_k")  # its source is not the stage before it
    event = ev.SamplingStages(step=1, req_id="r", t=1.0, position=0, stages=[logits, repeat, moved], chosen=5)
    path = tmp_path / "s.wbtrace"
    with TraceWriter(path) as w:
        w.write(event)
    stored = sqlite3.connect(path).execute("SELECT payload FROM events").fetchone()[0]
    assert stored.count('"repeat":true') == 1 and '"entropy":2.0' in stored
    assert list(open_trace(path).events(kind="sampling")) == [event]


def test_a_repeat_with_nothing_before_it_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.wbtrace"
    with TraceWriter(path) as w:
        w.write(ev.SamplingStages(step=1, req_id="r", t=1.0, stages=[{"name": "logits", "applied": True}]))
    conn = sqlite3.connect(path)
    conn.execute("""UPDATE events SET payload = '{"stages": [{"name": "x", "applied": false, "repeat": true}]}'""")
    conn.commit()
    conn.close()
    with pytest.raises(TraceError, match="corrupt event .*first stage cannot repeat"):
        list(open_trace(path).events(kind="sampling"))


def test_a_verify_step_counts_requests_not_packed_rows(tmp_path: Path) -> None:
    path = tmp_path / "v.wbtrace"
    with TraceWriter(path) as w:  # k = 2: each request's last token and two drafts, one row each
        w.write(ev.ForwardBatchBuilt(step=1, t=1.0, forward_mode="TARGET_VERIFY", batch_size=6,
                                     req_ids=["a", "a", "a", "b", "b", "b"], input_ids=[1, 2, 3, 4, 5, 6]))
        w.write(ev.ForwardDone(step=1, t=1.1, forward_mode="TARGET_VERIFY", batch_size=6, num_tokens=6))
    (step,) = open_trace(path).steps()
    assert (step.batch_size, step.num_tokens, step.req_ids) == (2, 6, ("a", "b"))


def test_a_batch_steps_events_share_rows_and_read_back_one_by_one(tmp_path: Path) -> None:
    """A traced batch writes each decode step's events of one kind (every row's logits, token,
    detok ...) as one row; the reader gives back exactly the events the engine emitted, in its
    order, and finds one request's events, a limit's worth of them and a frame's rows."""
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams
    from workbench.trace.recorder import MemorySink

    path, memory = tmp_path / "batch.wbtrace", MemorySink()
    with Engine("tiny-random", trace=str(path), trace_level="summary", trace_sinks=[memory]) as engine:
        engine.generate(["one", "two two", "three three three"],
                        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, logprobs=True))
    emitted = memory.events
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT count(*) FROM events").fetchone()[0]
        runs = db.execute("SELECT count(*) FROM events WHERE req_id IS NULL AND payload LIKE '{\"@rows\":%'").fetchone()[0]
    assert runs and rows < len(emitted) * 2 // 3, (rows, runs, len(emitted))
    with open_trace(path) as trace:
        assert list(trace.events()) == emitted and trace.num_events == len(emitted)
        for step in {e.step for e in emitted}:
            assert trace.step(step) == [e for e in emitted if e.step == step]
        for rid in ("req-0", "req-1", "req-2"):
            mine = [e for e in emitted if e.req_id == rid]
            assert len(mine) > 20 and list(trace.events(req_id=rid)) == mine
            tokens = [e for e in mine if e.kind == "token"]
            assert list(trace.events(kind="token", req_id=rid, limit=3)) == tokens[:3]
            assert trace.timeline(rid).events == mine
        assert list(trace.events(kind="detok", limit=4)) == [e for e in emitted if e.kind == "detok"][:4]
        frame = trace.tokens_frame()
        tokens = [e for e in emitted if e.kind == "token"]
        assert frame["req_id"].tolist() == [e.req_id for e in tokens]
        assert frame["token_id"].tolist() == [e.token_id for e in tokens]
        ids = trace.events_frame(kind="logits")["id"].tolist()
        assert len(ids) == len(set(ids)) == sum(e.kind == "logits" for e in emitted)
        assert list(trace.follow(from_start=True, idle_timeout=0)) == emitted


def test_layers_running_the_same_attention_are_stored_once_and_read_back_one_a_layer(tmp_path: Path) -> None:
    full = {"window": None, "softcap": None, "sinks": False, "scaling": 0.125}
    local = {"window": 4096, "softcap": 30.0, "sinks": True, "scaling": 0.125}
    attention = [full] * 5 + [local] + [full] * 3 + [dict(full)]  # the last: equal, not shared
    event = ev.ForwardBatchBuilt(step=1, t=0.5, batch_size=1, attention=attention)
    payload = event.payload()
    assert payload["attention"] == [full, local, full, full] and payload[ev.LAYER_RUNS] == [5, 1, 3, 1]
    path = tmp_path / "layers.wbtrace"
    with TraceWriter(path) as writer:
        writer.write(event)
    with open_trace(path) as trace:
        [back] = trace.events()
    assert back == event and len(back.attention) == 10
    for bad in ([5, 1, 3], [5, 0, 3, 1], [5, 1, 3, 10**9], "5"):
        with pytest.raises(ValueError, match="layer_runs"):
            ev.event_from_json({**event.to_json(), "payload": {**payload, ev.LAYER_RUNS: bad}})
