"""Reading capture back from a trace file (issue 18): numpy / pandas, no torch, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.trace.reader import open_trace
from workbench.trace.recorder import MemorySink

PROMPT = "Hello there, how are you doing today? I was thinking"


@pytest.fixture(scope="module")
def captured_trace(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("capture") / "cap.wbtrace"
    sink = MemorySink()
    with Engine(tiny, trace=str(path), trace_sinks=[sink]) as engine:
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=4), req_id="seen", capture=True)
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=4), req_id="plain")
        while engine.has_work():
            engine.step()
        layers = engine.runner.num_layers
        heads = int(engine.runner.config.num_attention_heads)
    return path, sink, layers, heads


def test_reader_gives_back_what_the_engine_captured(captured_trace):
    path, sink, layers, heads = captured_trace
    with open_trace(path) as trace:
        caps = trace.captures()
        assert [(c.req_id, c.position) for c in caps] == [("seen", p) for p in range(4)]
        for c in caps:
            np.testing.assert_array_equal(trace.hidden_states("seen", c.position), sink.tensors[c.tensors["hidden"]])
        hidden = trace.hidden_states("seen", 2)
        assert hidden.shape == (layers + 1, 64) and hidden.dtype == np.float32
        np.testing.assert_allclose(trace.residual_norms("seen", 2), np.linalg.norm(hidden, axis=-1), rtol=1e-5)
        lens = trace.logit_lens("seen", 2)
        token = next(t for t in sink.of_kind("token") if t.req_id == "seen" and t.position == 2)
        assert list(lens["layer"]) == list(range(-1, layers))
        last = lens.iloc[-1]
        assert last["chosen_rank"] == 1 and last["top_ids"][0] == token.token_id == last["chosen_id"]
        assert last["chosen_text"] == token.text == last["top_texts"][0]
        assert abs(last["chosen_logprob"] - token.logprob) < 1e-4  # the sampler's own logprob
        assert len(last["top_ids"]) == 10 and np.all(np.diff(last["top_logprobs"]) <= 0)
        grid = trace.lens_grid("seen")
        assert len(grid) == 4 * (layers + 1) and set(grid["position"]) == {0, 1, 2, 3}


def test_attention_and_the_text_each_position_points_at(captured_trace):
    path, sink, layers, heads = captured_trace
    with open_trace(path) as trace:
        att = trace.attention("seen", 3)
        c = trace.capture("seen", 3)
        assert att.positions.shape == att.weights.shape == (layers, heads, 10) and not att.whole
        assert att.entropy.shape == (layers, heads) and att.kv_len == c.kv_len
        assert att.positions.max() < c.kv_len and np.all(att.weights <= 1.0)
        top = att.top(layer=0, head=1, k=3)
        assert [p for p, _ in top] == att.positions[0, 1, :3].tolist()
        mean = att.top(layer=1, k=2)
        assert len(mean) == 2 and mean[0][1] >= mean[1][1]
        texts = trace.context_texts("seen")
        added = next(trace.events(kind="request.added", req_id="seen"))
        assert len(texts) == len(added.prompt_ids) + 4  # prompt tokens, then the outputs
        assert "".join(texts[:len(added.prompt_ids)]).strip() == PROMPT
        frame = att.frame()
        assert len(frame) == layers * heads * 10 and set(frame.columns) == {"layer", "head", "position", "weight"}


def test_what_was_not_captured_is_a_key_error_saying_what_was(captured_trace):
    path, *_ = captured_trace
    with open_trace(path) as trace:
        assert trace.captures("plain") == []
        with pytest.raises(KeyError, match=r"'plain' position 0 was not captured \(captured positions: \[\]\)"):
            trace.logit_lens("plain", 0)
        with pytest.raises(KeyError, match=r"position 9 was not captured \(captured positions: \[0, 1, 2, 3\]\)"):
            trace.hidden_states("seen", 9)


def test_reading_capture_never_imports_torch(captured_trace):
    path, *_ = captured_trace
    code = ("import sys, json; from workbench.trace import open_trace; t = open_trace(sys.argv[1]); "
            "lens = t.logit_lens('seen', 1); att = t.attention('seen', 1); h = t.hidden_states('seen', 1); "
            "print(json.dumps([int(lens['chosen_rank'].iloc[-1]), h.shape[0], 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rank, entries, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert rank == 1 and entries == 3 and torch_loaded is False
