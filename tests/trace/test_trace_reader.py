"""Reading traces: speed on a million events, filters, requests and timelines, frames, following a
live file, and one clear TraceError for every kind of bad file."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workbench.trace import events as ev
from workbench.trace.events import SCHEMA_VERSION
from workbench.trace.reader import Trace, TraceError, open_trace
from workbench.trace.store import TraceWriter
from workbench.trace.synth import write_synthetic_trace


@pytest.fixture(scope="session")
def million(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("big") / "million.wbtrace"
    start = time.perf_counter()
    info = write_synthetic_trace(path, 1_000_000)
    info["seconds"] = time.perf_counter() - start
    return path, info


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small") / "small.wbtrace"
    write_synthetic_trace(path, 6_000, seed=3)
    return path


@pytest.mark.slow  # its fixture writes a million events (~40 s)
def test_a_million_event_trace_opens_and_reads_a_step_fast(million: tuple[Path, dict],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path, info = million
    start = time.perf_counter()
    trace = open_trace(path)
    opened = time.perf_counter()
    events = trace.step(trace.num_steps // 2)
    read = time.perf_counter()
    with capsys.disabled():
        print(f"\n[trace bench] {info['events']} events, {info['steps']} steps, "
              f"{info['bytes'] / info['events']:.0f} bytes/event, written in {info['seconds']:.1f} s; "
              f"open {1000 * (opened - start):.1f} ms, read one step ({len(events)} events) "
              f"{1000 * (read - opened):.1f} ms")
    assert info["events"] >= 1_000_000 and events
    assert read - start < 2.0  # generous: the real number goes to BENCHMARKS.md
    trace.close()


def test_filters_match_a_brute_force_scan(small: Path) -> None:
    with open_trace(small) as trace:
        everything = list(trace.events())
        assert len(everything) == trace.num_events
        assert [e.step for e in everything] == sorted(e.step for e in everything)
        rid = "req-3"
        assert list(trace.events(kind="token")) == [e for e in everything if e.kind == "token"]
        kinds = ["spec.verify", "request.finished"]
        assert list(trace.events(kind=kinds)) == [e for e in everything if e.kind in kinds]
        assert list(trace.events(req_id=rid)) == [e for e in everything if e.req_id == rid]
        window = [e for e in everything if 5 <= e.step <= 9]
        assert list(trace.events(step_range=(5, 9))) == window
        assert list(trace.events(kind="token", req_id=rid, step_range=(5, 30))) == [
            e for e in everything if e.kind == "token" and e.req_id == rid and 5 <= e.step <= 30]
        assert list(trace.events(limit=7)) == everything[:7]
        steps = trace.steps()
        assert trace.num_steps == len(steps) and sum(s.num_events for s in steps) == len(everything)
        assert all(trace.step(s.step) == [e for e in everything if e.step == s.step] for s in steps[:20])
        assert trace.step(10**9) == []


def test_requests_and_timelines(small: Path) -> None:
    with open_trace(small) as trace:
        requests = trace.requests()
        assert requests and requests[0].req_id == "req-0" and requests[0].arrival_step is not None
        done = [r for r in requests if r.finished is not None]
        assert done and all(r.finish_reason in ("stop", "length") for r in done)
        req = done[0]
        timeline = trace.timeline(req.req_id)
        assert timeline.added == req.added and timeline.finished == req.finished
        assert [t.position for t in timeline.tokens] == list(range(req.finished.usage["completion_tokens"]))
        assert all(t.logprob is not None for t in timeline.tokens)
        assert timeline.steps and timeline.steps[0] >= req.arrival_step
        assert all(e.req_id == req.req_id for e in timeline.events)
        assert trace.timeline("no-such-request").events == []


def test_frames(small: Path) -> None:
    with open_trace(small) as trace:
        tokens = trace.tokens_frame()
        assert list(tokens.columns) == ["req_id", "position", "step", "token_id", "text", "logprob", "rank",
                                        "source", "t"]
        assert len(tokens) == sum(1 for _ in trace.events(kind="token"))
        assert set(tokens["source"]) <= {"sample", "spec_accept", "spec_recover", "spec_bonus"}
        steps = trace.steps_frame()
        assert len(steps) == trace.num_steps and {"mode", "batch_size", "kv_used", "forward_ms"} <= set(steps)
        forwards = trace.events_frame(kind="forward", step_range=(0, 50))
        assert {"id", "step", "kind", "forward_ms", "model"} <= set(forwards.columns)
        assert (forwards["kind"] == "forward").all() and forwards["step"].max() <= 50
        assert trace.events_frame(kind="nothing").empty


def test_follow_yields_events_as_a_live_writer_commits_them(tmp_path: Path) -> None:
    path = tmp_path / "live.wbtrace"
    writer = TraceWriter(path)
    writer.write(ev.Stamp(step=0, req_id="r", stage="arrival"))
    writer.flush()
    trace = open_trace(path)
    assert trace.num_events == 1 and not trace.finished

    def record() -> None:
        for step in range(1, 30):
            writer.write(ev.TokenChosen(step=step, req_id="r", position=step - 1, token_id=step))
            if step % 5 == 0:
                writer.flush()
                time.sleep(0.01)
        writer.close()

    thread = threading.Thread(target=record)
    thread.start()
    followed = list(trace.follow(poll=0.01, idle_timeout=10))
    thread.join()
    assert [e.step for e in followed] == list(range(1, 30))  # only what came after opening, in order
    assert trace.finished and trace.num_events == 30 and trace.num_steps == 30
    assert trace.refresh() == 0
    assert len(list(trace.follow(from_start=True, idle_timeout=1))) == 30
    trace.close()


def test_refresh_picks_up_new_steps(tmp_path: Path) -> None:
    path = tmp_path / "live.wbtrace"
    with TraceWriter(path) as writer:
        writer.write(ev.Stamp(step=0, req_id="r"))
        writer.flush()
        with open_trace(path) as trace:
            assert trace.num_steps == 1
            writer.write(ev.Stamp(step=1, req_id="r"))
            writer.flush()
            assert trace.num_steps == 1  # steps are cached until refresh
            assert trace.refresh() == 1 and trace.num_steps == 2


# --- bad files: one TraceError each, a clear one-line message --------------------------------------


def expect_trace_error(path: Path, *phrases: str) -> str:
    with pytest.raises(TraceError) as info:
        read_everything(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message and str(path.parent) not in message
    assert any(p in message for p in phrases), message
    return message


def read_everything(path: Path) -> None:
    with open_trace(path) as trace:
        trace.check()
        trace.steps()
        list(trace.events())
        trace.requests()


def test_missing_empty_and_foreign_files(tmp_path: Path) -> None:
    expect_trace_error(tmp_path / "absent.wbtrace", "no such trace file")
    (tmp_path / "empty.wbtrace").write_bytes(b"")
    expect_trace_error(tmp_path / "empty.wbtrace", "empty file")
    (tmp_path / "notes.wbtrace").write_text("just some text\n" * 100)
    expect_trace_error(tmp_path / "notes.wbtrace", "not an SQLite database")
    expect_trace_error(tmp_path, "is a directory")


def test_a_foreign_sqlite_database(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users(id INTEGER, name TEXT)")
    expect_trace_error(other, "not a workbench trace")
    kv = tmp_path / "kv.db"
    with sqlite3.connect(kv) as conn:
        conn.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('format', 'plain text, not JSON')")
    expect_trace_error(kv, "not a workbench trace")


def test_a_newer_schema_version(small: Path, tmp_path: Path) -> None:
    path = tmp_path / "future.wbtrace"
    path.write_bytes(small.read_bytes())
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    message = expect_trace_error(path, "newer")
    assert f"version {SCHEMA_VERSION + 1}" in message and "upgrade" in message


def test_a_truncated_file(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    for size in (len(data) // 2, 4096 + 7, 60):
        path = tmp_path / f"cut{size}.wbtrace"
        path.write_bytes(data[:size])
        expect_trace_error(path, "truncated")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_file_with_random_bytes_overwritten(small: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    data = bytearray(small.read_bytes())
    page = 4096
    for _ in range(8):  # eight random pages of random bytes, somewhere past the header page
        start = rng.randrange(1, len(data) // page) * page
        data[start:start + page] = rng.randbytes(page)
    path = tmp_path / "noise.wbtrace"
    path.write_bytes(bytes(data))
    expect_trace_error(path, "corrupt")
    header = tmp_path / "header.wbtrace"
    header.write_bytes(rng.randbytes(100) + bytes(data[100:]))
    expect_trace_error(header, "not an SQLite database")


def test_a_corrupt_event_payload_names_the_event(small: Path, tmp_path: Path) -> None:
    path = tmp_path / "payload.wbtrace"
    path.write_bytes(small.read_bytes())
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET payload = '{\"position\": 1, ' WHERE id = 42")
    with open_trace(path) as trace, pytest.raises(TraceError, match="corrupt event #42"):
        list(trace.events())


def test_importing_the_reader_loads_neither_torch_nor_pandas() -> None:
    code = ("import sys, workbench.trace.reader, workbench.trace.export, workbench.trace.store; "
            "print(sorted(m for m in ('torch', 'transformers', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_trace_is_reexported_lazily() -> None:
    import workbench
    import workbench.trace

    assert workbench.trace.open_trace is open_trace and workbench.open_trace is open_trace
    assert isinstance(Trace, type)
