"""Replay saves the replayed run and compares at the level asked for: an untouched trace replays to
an identical trace (by diff); a chunk-size change keeps every token (`--compare tokens` passes) but
changes the schedule (`--compare steps` names the schedule stage and the override behind it)."""

from __future__ import annotations

import pytest

from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.replay import replay
from workbench.trace.diff import diff_traces
from workbench.trace.reader import open_trace

PROMPTS = [f"Request number {i} asks about the weather in city {i} and the trains that leave it" for i in range(8)]
N = 8


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "run.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=N) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=10 + i, max_new_tokens=N) for i in range(8)]
    with Engine(tiny, trace=str(path), chunk_size=64) as engine:
        engine.generate(PROMPTS, params)
    return path


def test_replay_out_is_identical_by_diff(recorded, tmp_path, capsys):
    out = tmp_path / "replayed.wbtrace"
    assert cli_main(["replay", str(recorded), "--out", str(out)]) == 0
    assert "saved to" in capsys.readouterr().out
    with open_trace(recorded) as a, open_trace(out) as b:
        report = diff_traces(a, b)
        assert b.meta["replay"]["parent"] == str(recorded)
        assert len(b.requests()) == 8
    assert report.identical and all(r.compared == N for r in report.requests)
    assert cli_main(["diff", str(recorded), str(out)]) == 0


def test_chunk_size_keeps_tokens_changes_steps(recorded, tmp_path, capsys):
    assert cli_main(["replay", str(recorded), "--override", "engine.chunk_size=8", "--compare", "tokens"]) == 0
    text = capsys.readouterr().out
    assert "identical (tokens)" in text and "engine.chunk_size=8" in text and "the steps differ" in text
    assert cli_main(["replay", str(recorded), "--override", "engine.chunk_size=8", "--compare", "steps"]) == 1
    text = capsys.readouterr().out
    assert "stage 'schedule'" in text and "follows from: --override engine.chunk_size=8" in text
    out = tmp_path / "chunked.wbtrace"
    report = replay(str(recorded), overrides=["engine.chunk_size=8"], compare="outputs", out=str(out), progress=False)
    assert report.identical and report.step_divergence.stage == "schedule"
    with open_trace(recorded) as a, open_trace(out) as b:
        assert b.num_steps > a.num_steps  # the prompts took more, smaller chunks
        assert diff_traces(a, b).first_divergence is None


def test_changed_temperature_names_its_override(recorded):
    report = replay(str(recorded), overrides=["req-2:temperature=1.5"], compare="tokens", progress=False)
    d = report.divergence
    assert d is not None and d.req_id == "req-2" and d.stage == "token" and d.position is not None
    assert d.cause.startswith("--override req-2:temperature=1.5") and d.near_tie is not None


def test_bad_compare_and_string_model_meta(recorded, tmp_path, capsys):
    with pytest.raises(ValueError, match="compare must be one of"):
        replay(str(recorded), compare="bytes", progress=False)
    import json
    import sqlite3

    copy = tmp_path / "string_model.wbtrace"
    copy.write_bytes(recorded.read_bytes())
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE meta SET value=? WHERE key='model'", (json.dumps("tiny-random"),))
    assert cli_main(["replay", str(copy)]) == 2
    assert "meta 'model'" in capsys.readouterr().err


def test_diff_says_where_kl_is_not_defined(recorded, tiny, tmp_path, capsys):
    bare = tmp_path / "no_topk.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=N) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=10 + i, max_new_tokens=N) for i in range(8)]
    with Engine(tiny, trace=str(bare), chunk_size=64, trace_topk=0) as engine:
        engine.generate(PROMPTS, params)
    with open_trace(recorded) as a, open_trace(bare) as b:
        report = diff_traces(a, b)
    assert report.first_divergence is None and all(r.mean_kl is None for r in report.requests)
    assert cli_main(["diff", str(recorded), str(bare)]) == 0
    text = capsys.readouterr().out
    assert "KL not defined where B has no top-k distribution" in text and " n/a " in text


@pytest.mark.parametrize("order", ["restart", "fifo"])
def test_an_engine_gone_idle_starts_again_from_slot_1_and_replays_identically(tiny, tmp_path, order):
    path = tmp_path / f"{order}.wbtrace"
    with Engine(tiny, trace=str(path), kv_slot_order=order) as engine:
        for prompt in PROMPTS[:2]:  # one after the other: every slot is free between them
            engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=N))
    with open_trace(path) as t:
        assert t.meta["engine"]["kv_slot_order"] == order
        starts = [e.out_cache_loc[0] for e in t.events(kind="forward_batch") if e.forward_mode == "EXTEND"]
    assert len(starts) == 2 and starts[0] == 1
    assert (starts[1] == 1) == (order == "restart"), starts
    report = replay(str(path), progress=False)
    assert report.identical, report.divergence.describe()
