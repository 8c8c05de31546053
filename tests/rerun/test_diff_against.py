"""`workbench diff T --against transformers` from the command line: transformers' greedy generate()
of the trace's own prompts matches the engine token for token (smollm2); sampled requests are named
as not compared."""

from __future__ import annotations

import pytest

from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.trace.reader import open_trace

CHATS = [[{"role": "user", "content": text}] for text in (
    "Name three planets.", "What is 7 times 8?", "Write a haiku about rain.", "Say hello in French.")]


@pytest.mark.slow
def test_diff_against_transformers_from_the_cli(smollm2, tmp_path, capsys):
    path, hf = tmp_path / "engine.wbtrace", tmp_path / "hf.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=16), SamplingParams(temperature=0.9, seed=3, max_new_tokens=8),
              SamplingParams(temperature=0, max_new_tokens=16, stop=["\n"]), SamplingParams(temperature=0, max_new_tokens=16)]
    with Engine(smollm2, trace=str(path), chunk_size=16) as engine:
        engine.generate(CHATS, params)
    assert cli_main(["diff", str(path), "--against", "transformers", "--against-out", str(hf)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("no token differs") and "not compared: req-1 (sampled at temperature 0.9" in text
    with open_trace(path) as a, open_trace(hf) as b:
        assert [r.req_id for r in b.requests()] == ["req-0", "req-2", "req-3"]
        for rid in ("req-0", "req-2", "req-3"):
            ours = [t.token_id for t in a.timeline(rid).tokens]
            theirs = [t.token_id for t in b.timeline(rid).tokens]
            assert ours == theirs and len(ours) > 0


def test_against_needs_a_model_and_a_known_peer(tmp_path, capsys):
    from workbench.trace.synth import write_synthetic_trace

    path = tmp_path / "synthetic.wbtrace"
    write_synthetic_trace(str(path), num_events=200)
    assert cli_main(["diff", str(path), "--against", "vllm"]) == 2
    assert "--against must be one of transformers" in capsys.readouterr().err
    assert cli_main(["diff", str(path)]) == 2
    assert "give a second trace B" in capsys.readouterr().err
