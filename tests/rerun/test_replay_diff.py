"""Replay and diff: a recorded run re-executes identically; a changed parameter or chunk size is
named at its first divergent step, request and stage; engine traces diff against transformers."""

from __future__ import annotations

import json
import sqlite3

import pytest

from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.external.hf_generate import record_hf_trace
from workbench.rerun.replay import replay
from workbench.trace.diff import diff_traces
from workbench.trace.reader import open_trace

CHATS = [[{"role": "user", "content": text}] for text in (
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.", "Name three planets.",
    "What is 7 times 8?", "Write a haiku about rain.", "Count from one to six.", "Say hello in French.",
    "Give me a word that rhymes with cat.", "List two colors.")]


@pytest.fixture(scope="module")
def recorded(smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "run.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=16) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=16) for i in range(8)]
    with Engine(smollm2, trace=str(path), spec="ngram:k=4", chunk_size=24) as engine:
        outs = engine.generate(CHATS, params)
    return path, outs


def test_replay_is_identical(recorded, capsys):
    path, outs = recorded
    with open_trace(path) as trace:
        assert len(trace.requests()) == 8 and list(trace.events(kind="spec.verify", limit=1))
    assert cli_main(["replay", str(path)]) == 0
    assert "identical" in capsys.readouterr().out
    report = replay(str(path), progress=False)
    assert report.identical and report.tokens_compared == sum(len(o.token_ids) for o in outs)


def test_replay_names_changed_temperature(recorded, capsys):
    path, _ = recorded
    assert cli_main(["replay", str(path), "--override", "req-3:temperature=0.2"]) == 1
    text = capsys.readouterr().out
    assert "request req-3" in text and "stage 'token'" in text and "first divergence at step" in text
    report = replay(str(path), overrides=["req-3:temperature=0.2"], progress=False)
    assert report.divergence.req_id == "req-3" and report.divergence.near_tie is not None


def test_replay_names_changed_chunk_size(recorded, capsys):
    path, _ = recorded
    assert cli_main(["replay", str(path), "--override", "engine.chunk_size=8"]) == 1
    report = replay(str(path), overrides=["engine.chunk_size=8"], progress=False)
    assert report.divergence.step == 1 and report.divergence.stage == "schedule"


def test_replay_refuses_a_different_model(recorded, tmp_path):
    path, _ = recorded
    copy = tmp_path / "other.wbtrace"
    copy.write_bytes(path.read_bytes())
    with sqlite3.connect(copy) as conn:
        model = json.loads(conn.execute("SELECT value FROM meta WHERE key='model'").fetchone()[0])
        model["hash"] = "0" * 16
        conn.execute("UPDATE meta SET value=? WHERE key='model'", (json.dumps(model),))
    with pytest.raises(ValueError, match="different model"):
        replay(str(copy), progress=False)


@pytest.mark.slow  # loads SmolLM2
def test_diff_engine_against_transformers(smollm2, tmp_path, capsys):
    prompts = CHATS[:3]
    eng_path, hf_path = tmp_path / "engine.wbtrace", tmp_path / "hf.wbtrace"
    with Engine(smollm2, trace=str(eng_path)) as engine:
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, top_logprobs=5))
    record_hf_trace(str(hf_path), "smollm2", prompts, max_new_tokens=12)
    with open_trace(eng_path) as a, open_trace(hf_path) as b:
        report = diff_traces(a, b)
    assert report.first_divergence is None
    assert all(r.compared > 0 and r.max_logprob_delta < 1e-3 for r in report.requests)
    assert cli_main(["diff", str(eng_path), str(hf_path)]) == 0


@pytest.mark.slow  # loads SmolLM2
def test_diff_finds_first_divergence(smollm2, tmp_path):
    paths = []
    for temp in (0.0, 1.5):
        path = tmp_path / f"t{temp}.wbtrace"
        with Engine(smollm2, trace=str(path)) as engine:
            engine.generate(CHATS[1], SamplingParams(temperature=temp, seed=5, max_new_tokens=12))
        paths.append(path)
    with open_trace(paths[0]) as a, open_trace(paths[1]) as b:
        report = diff_traces(a, b)
    first = report.first_divergence
    assert first is not None and first.token_a != first.token_b and not report.identical


def test_bad_trace_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.wbtrace"
    bad.write_bytes(b"not a trace at all" * 10)
    assert cli_main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err
