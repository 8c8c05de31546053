"""Fork a recorded run at a token: the prefix and every other request stay as recorded, the forced
token sits at the branch point, and the branch continues exactly as a fresh run of prompt + forced
prefix would (greedy). The fork is a trace naming its parent; diff shows where the branches part."""

from __future__ import annotations

import pytest

import workbench
from tests.helpers.tui_pilot import pane, tui
from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.trace.reader import open_trace

PROMPTS = [f"Story {i}: the lighthouse keeper counted {i} ships before the storm came" for i in range(8)]
N = 10


@pytest.fixture(scope="module")
def parent(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("fork") / "parent.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=40 + i, max_new_tokens=N, ignore_eos=True) for i in range(8)]
    with Engine(tiny, trace=str(path)) as engine:
        engine.generate(PROMPTS, params)
    with open_trace(path) as t:
        tokens = {r.req_id: [e.token_id for e in t.timeline(r.req_id).tokens] for r in t.requests()}
        runner_up = t.timeline("req-3").tokens[5].top_logprobs[1]
    return path, tokens, runner_up


@pytest.fixture(scope="module")
def forked(parent, tmp_path_factory):
    out = tmp_path_factory.mktemp("fork") / "fork.wbtrace"
    return out, workbench.fork(str(parent[0]), "req-3:5", token="rank:2", out=str(out))


def test_fork_forces_runner_up_and_keeps_the_rest(parent, forked, tiny):
    path, tokens, runner_up = parent
    out, result = forked
    assert result.branch.token == runner_up[0] != tokens["req-3"][5]
    with open_trace(out) as f:
        forked = {r.req_id: [e.token_id for e in f.timeline(r.req_id).tokens] for r in f.requests()}
        meta = f.meta["fork"]
        sources = [e.source for e in f.timeline("req-3").tokens]
    assert meta["parent"] == str(path) and (meta["req_id"], meta["position"]) == ("req-3", 5)
    assert forked["req-3"][:5] == tokens["req-3"][:5] and forked["req-3"][5] == runner_up[0]
    assert sources[5] == "forced" and sources.count("forced") == 1
    assert all(forked[r] == tokens[r] for r in tokens if r != "req-3")
    # the branch continues as a fresh greedy run of prompt + forced prefix would
    with open_trace(path) as t:
        prompt_ids = t.timeline("req-3").added.prompt_ids
    with Engine(tiny, trace_level="off") as fresh:
        (out_fresh,) = fresh.generate([prompt_ids + forked["req-3"][:6]],
                                      SamplingParams(temperature=0, max_new_tokens=N - 6, ignore_eos=True))
    assert forked["req-3"][6:] == out_fresh.token_ids
    report = result.report
    assert report.first_divergence.req_id == "req-3" and report.first_divergence.position == 5
    assert report.first_divergence.verdict.forced and report.request("req-3").shared_prefix == 5


def test_fork_cli_set_temperature_and_diff(parent, tmp_path, capsys):
    path, tokens, _ = parent
    out = tmp_path / "greedy.wbtrace"
    assert cli_main(["fork", str(path), "--at", "req-2:3", "--set", "temperature=0", "--out", str(out)]) == 0
    capsys.readouterr()
    with open_trace(out) as f:
        assert f.meta["fork"]["set"] == {"temperature": 0}
        params = [e for e in f.events(kind="forward_batch") if "req-2" in e.req_ids][-1].sampling_info
        forked = [e.token_id for e in f.timeline("req-2").tokens]
    assert forked[:3] == tokens["req-2"][:3]
    assert next(p for p in params if p["req_id"] == "req-2")["temperature"] == 0
    code = cli_main(["diff", str(path), str(out)])
    text = capsys.readouterr().out
    assert f"fork of {str(path)!r} at req-2:3 (set temperature=0)" in text and "shared prefix" in text
    assert code == (0 if forked == tokens["req-2"] else 1)


def test_fork_bad_input_is_a_clear_error(parent, tmp_path, capsys):
    path, _, _ = parent
    out = str(tmp_path / "x.wbtrace")
    for args, msg in ((["--at", "req-3"], "REQ:POSITION"), (["--at", "req-3:99", "--token", "1"], "position must be"),
                      (["--at", "req-9:1", "--token", "1"], "no recorded tokens"),
                      (["--at", "req-3:1", "--token", "rank:99"], "rank must be"),
                      (["--at", "req-3:1", "--set", "n=2"], "cannot change n")):
        assert cli_main(["fork", str(path), *args, "--out", out]) == 2, args
        assert msg in capsys.readouterr().err


@pytest.mark.anyio
async def test_tui_marks_the_branch_point(forked):
    out, _ = forked
    async with tui(out, request="req-3") as (pilot, screen):
        status = str(screen.query_one("#status").render())
        assert "⑂ fork of parent.wbtrace at req-3:5 (forced" in status
        chips = pane(screen, "tokens")
        assert chips.count("⑂") == 1


def test_diff_view_aligns_positions_and_marks_the_branch(parent, forked):
    from workbench.notebook import DiffView

    path, tokens, runner_up = parent
    out, _ = forked
    view = DiffView(str(path), str(out), req_ids=["req-3", "req-1"])
    rows = view.rows("req-3")
    assert [r["state"] for r in rows] == ["same"] * 5 + ["forced"] + ["after"] * (N - 6)
    assert rows[5]["text_b"] == runner_up[2] and rows[5]["text_a"] != rows[5]["text_b"]
    assert all(r["state"] == "same" and r["text_a"] == r["text_b"] for r in view.rows("req-1"))
    page = view._repr_html_()
    assert page.count("<tr class='forced'>") == 1 and "⑂" in page and "shared prefix 5 of 10" in page


def test_engine_hooks_force_a_token_and_change_params(tiny):
    with Engine(tiny) as engine:
        (rid,) = engine.add_request("The harbour at dawn", SamplingParams(temperature=0, max_new_tokens=6,
                                                                          ignore_eos=True))
        engine.force_token(rid, 2, 1234)
        with pytest.raises(ValueError, match="token must be an id"):
            engine.force_token(rid, 3, engine.vocab_size)
        with pytest.raises(ValueError, match="cannot change stop"):
            engine.update_params(rid, stop=["x"])
        while not engine.reqs[rid].output_ids:
            engine.step()
        with pytest.raises(ValueError, match="position must be an int >= 1"):
            engine.force_token(rid, 0, 5)
        engine.update_params(rid, temperature=0.7, seed=3)
        while rid not in engine.finished:
            engine.step()
        out = engine.finished[rid]
        sink = engine.memory_sink
    assert out.token_ids[2] == 1234 and len(out.token_ids) == 6
    token_events = [e for e in sink.events if e.kind == "token" and e.req_id == rid]
    assert [e.source for e in token_events].count("forced") == 1 and token_events[2].source == "forced"
    sampled = [e for e in sink.events if e.kind == "forward_batch"][-1].sampling_info[0]
    assert sampled["temperature"] == 0.7 and sampled["seed"] == 3


def test_token_is_an_id_one_tokens_text_or_a_rank(parent, tiny):
    from workbench.rerun.fork import resolve_token

    path, _, runner_up = parent
    with open_trace(path) as t:
        recorded = t.timeline("req-3").tokens[5]
    (the,) = tiny.tokenizer.encode(" the", add_special_tokens=False)
    assert resolve_token(" the", tiny.tokenizer, recorded) == the
    assert resolve_token("17", tiny.tokenizer, recorded) == 17
    assert resolve_token("rank:2", tiny.tokenizer, recorded) == runner_up[0]
    with pytest.raises(ValueError, match="give the text of one token"):
        resolve_token(" the lighthouse keeper", tiny.tokenizer, recorded)


def test_fork_of_a_speculative_run_forces_inside_a_verified_run(tiny, tmp_path):
    """The parent speculated (a draft model equal to the target, so greedy verify steps commit k+1
    tokens at once); the fork speculates too, forces a token in the middle of such a run, and every
    other request, sampled ones included, comes out as recorded."""
    path, out = tmp_path / "spec.wbtrace", tmp_path / "spec-fork.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=7 + i, max_new_tokens=N, ignore_eos=True) for i in range(4)]
    with Engine(tiny, trace=str(path), spec="draft:tiny-random:k=3") as engine:
        engine.generate(PROMPTS[:4], params)
    with open_trace(path) as t:
        tokens = {r.req_id: [e.token_id for e in t.timeline(r.req_id).tokens] for r in t.requests()}
        assert [e.source for e in t.timeline("req-1").tokens][1:4] == ["spec_accept"] * 3  # a verified run
        prompt_ids = t.timeline("req-1").added.prompt_ids
    result = workbench.fork(str(path), "req-1:2", token="rank:2", out=str(out))
    with open_trace(out) as f:
        forked = {r.req_id: [e.token_id for e in f.timeline(r.req_id).tokens] for r in f.requests()}
        sources = [e.source for e in f.timeline("req-1").tokens]
        assert f.meta["engine"]["spec"] is not None and sum(s.spec_proposed for s in f.steps()) > 0
    assert forked["req-1"][:2] == tokens["req-1"][:2] and forked["req-1"][2] == result.branch.token
    assert result.branch.token != tokens["req-1"][2] and sources[2] == "forced" and sources.count("forced") == 1
    assert all(forked[r] == tokens[r] for r in tokens if r != "req-1")
    with Engine(tiny, trace_level="off") as fresh:
        (cont,) = fresh.generate([prompt_ids + forked["req-1"][:3]],
                                 SamplingParams(temperature=0, max_new_tokens=N - 3, ignore_eos=True))
    assert forked["req-1"][3:] == cont.token_ids
