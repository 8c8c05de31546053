"""Exports: Perfetto JSON checked event by event against the Trace Event Format, and per-token
tables that pandas reads back unchanged."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from workbench.trace import events as ev
from workbench.trace.export import export_perfetto, export_tokens
from workbench.trace.format import shown_mode
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter
from workbench.trace.synth import write_synthetic_trace

REQUIRED = ("name", "ph", "ts", "pid", "tid")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "synthetic.wbtrace"
    write_synthetic_trace(path, 15_000, seed=5, spec_every=3)
    return path


def load_perfetto(path: Path) -> list[dict[str, Any]]:
    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token} (Perfetto rejects NaN/Infinity)")

    doc = json.loads(path.read_text(), parse_constant=reject)
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    return doc["traceEvents"]


def validate_trace_event_format(events: list[dict[str, Any]]) -> None:
    """Every event has the keys its phase needs; X slices nest properly on each (pid, tid) track."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    for e in events:
        assert all(k in e for k in REQUIRED), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                     for v in e["args"].values()), e
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index", "process_sort_index"), e
            assert "name" in e["args"] or "sort_index" in e["args"], e
        else:
            raise AssertionError(f"unexpected phase {e['ph']!r}")
    for track, slices in tracks.items():
        open_ends: list[int] = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{name} at {start} overlaps its parent on {track}"
            open_ends.append(end)


def test_perfetto_export_follows_the_trace_event_format(synthetic: Path, tmp_path: Path) -> None:
    out = export_perfetto(synthetic, tmp_path / "trace.json")
    events = load_perfetto(out)
    validate_trace_event_format(events)
    with open_trace(synthetic) as trace:
        steps, requests = trace.steps(), trace.requests()
    names = {(e["name"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert names[("process_name", 0)].startswith("workbench engine")
    assert names[("thread_name", 0)] == "steps"
    lanes = {v for (k, _), v in names.items() if k == "thread_name"} - {"steps"}
    assert lanes == {f"request {r.req_id}" for r in requests}  # one lane per request
    step_slices = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(step_slices) == len(steps)
    # a step that verified drafts is TARGET_VERIFY even where the stored summary says DECODE
    assert [e["name"] for e in step_slices] == [shown_mode(s.mode, s.spec_proposed) for s in steps]
    assert any(s.spec_proposed for s in steps) and "TARGET_VERIFY" in {e["name"] for e in step_slices}
    assert all(e["args"]["batch_size"] == s.batch_size for e, s in zip(step_slices, steps))
    request_slices = [e for e in events if e["ph"] == "X" and e["tid"] > 0]
    assert {"queued", "prefill", "decode"} <= {e["name"] for e in request_slices}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"batch", "kv_cache", "spec_acceptance"}
    rates = [e["args"]["rate"] for e in events if e["name"] == "spec_acceptance"]
    assert rates and all(0 <= r <= 1 for r in rates)


def test_perfetto_request_spans_match_the_recorded_run(tmp_path: Path) -> None:
    path = tmp_path / "run.wbtrace"
    with TraceWriter(path, {"model": {"name": "tiny"}}) as writer:
        writer.write(ev.RequestAdded(step=0, req_id="a", t=1.0, prompt_ids=[1, 2]))
        writer.write(ev.ScheduleDecision(step=1, t=1.5, mode="EXTEND", prefill=[{"req_id": "a"}], kv_used=2,
                                         kv_total=8))
        writer.write(ev.ForwardDone(step=1, t=1.6, forward_mode="EXTEND", batch_size=1, num_tokens=2,
                                    forward_ms=float("nan")))  # a bad number never reaches the JSON
        writer.write(ev.TokenChosen(step=1, req_id="a", t=1.7, token_id=5))
        writer.write(ev.ScheduleDecision(step=2, t=2.0, mode="DECODE", decode=["a"], kv_used=3, kv_total=8))
        writer.write(ev.TokenChosen(step=2, req_id="a", t=2.1, position=1, token_id=6))
        writer.write(ev.RequestFinished(step=2, req_id="a", t=2.2, finish_reason="length"))
    events = load_perfetto(export_perfetto(path, tmp_path / "run.json"))
    validate_trace_event_format(events)
    spans = {e["name"]: (e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 1}
    assert spans == {"a": (0, 1_200_000), "queued": (0, 500_000), "prefill": (500_000, 200_000),
                     "decode": (700_000, 500_000)}
    kv = [e["args"] for e in events if e["name"] == "kv_cache"]
    assert kv == [{"used": 2, "free": 6}, {"used": 3, "free": 5}]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_token_export_reads_back_in_pandas(synthetic: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"tokens{suffix}"
    with open_trace(synthetic) as trace:
        rows = export_tokens(trace, out)
        expected = trace.tokens_frame()
    back = pd.read_parquet(out) if suffix == ".parquet" else pd.read_csv(out, keep_default_na=False)
    assert rows == len(expected) == len(back) > 0
    assert list(back.columns) == ["req_id", "position", "step", "token_id", "text", "logprob", "rank", "source", "t"]
    assert back["text"].tolist() == expected["text"].tolist()  # unicode, quotes, newlines, backslashes
    assert back["token_id"].tolist() == expected["token_id"].tolist()
    assert back["logprob"].tolist() == pytest.approx(expected["logprob"].tolist())
    assert back["req_id"].tolist() == expected["req_id"].tolist()


def test_token_export_rejects_other_suffixes(synthetic: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.parquet or \.csv"):
        export_tokens(synthetic, tmp_path / "tokens.xlsx")
