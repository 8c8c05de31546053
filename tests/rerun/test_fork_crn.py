"""Forks share their parent's random numbers (issue 35): a fork of a sampled request draws the same
uniform at every position as the parent did, so its continuation differs only because of the
intervention; every other request of the batch, seeded or not, runs exactly as recorded.

What a user notices: forcing the parent's own token gives the parent back, token for token; two
forks of one sampled request agree before the branch point, differ from it, and used the same draws
at every position; changing one request to greedy leaves the unseeded sampled requests beside it
untouched (without the recorded draws they would take each other's random numbers); the fork says
whether it is an exact re-execution or a re-fed prefix.
"""

from __future__ import annotations

import pytest

import workbench
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.fork import EXACT, REFED, recorded_draws
from workbench.trace.reader import open_trace

PROMPTS = [f"Note {i}: the ferry left the harbour at {i} o'clock with" for i in range(6)]
N = 10


def _params(i: int) -> SamplingParams:
    if i in (0, 1):  # seeded, sampled
        return SamplingParams(temperature=0.9, seed=100 + i, max_new_tokens=N, ignore_eos=True)
    if i in (2, 3):  # sampled without a seed: torch's global generator, shared by the batch
        return SamplingParams(temperature=0.9, max_new_tokens=N, ignore_eos=True)
    return SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True)


def _tokens(path) -> dict[str, list[int]]:
    with open_trace(path) as t:
        return {r.req_id: [e.token_id for e in t.timeline(r.req_id).tokens] for r in t.requests()}


def _draws(path) -> dict[str, dict[int, float]]:
    with open_trace(path) as t:
        return recorded_draws(t)


@pytest.fixture(scope="module")
def parent(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("crn") / "parent.wbtrace"
    with Engine(tiny, trace=str(path)) as engine:
        engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    return path


def test_forcing_the_parents_own_token_gives_the_parent_back(parent, tmp_path):
    tokens = _tokens(parent)
    out = tmp_path / "same.wbtrace"
    result = workbench.fork(str(parent), "req-0:4", token=tokens["req-0"][4], out=str(out))
    assert result.mode == EXACT and "recorded random draws" in result.describe()
    assert _tokens(out) == tokens
    assert _draws(out) == _draws(parent)
    with open_trace(out) as f:
        assert f.meta["fork"]["mode"] == EXACT


def test_two_forks_differ_only_from_the_branch_point_with_the_same_draws(parent, tmp_path):
    tokens, draws = _tokens(parent), _draws(parent)
    a, b = tmp_path / "a.wbtrace", tmp_path / "b.wbtrace"
    workbench.fork(str(parent), "req-1:4", token="rank:2", out=str(a))
    workbench.fork(str(parent), "req-1:4", token="rank:3", out=str(b))
    ta, tb = _tokens(a), _tokens(b)
    assert ta["req-1"][:4] == tb["req-1"][:4] == tokens["req-1"][:4]
    assert ta["req-1"][4] != tb["req-1"][4]
    # the same uniform at every sampled position, before and after the branch, in both forks
    da, db = _draws(a), _draws(b)
    shared = [p for p in draws["req-1"] if p != 4]
    assert shared and all(da["req-1"][p] == db["req-1"][p] == draws["req-1"][p] for p in shared)
    for rid in tokens:  # the rest of the batch, seeded or not, as recorded
        if rid != "req-1":
            assert ta[rid] == tb[rid] == tokens[rid], rid


def test_a_request_turned_greedy_leaves_the_unseeded_ones_beside_it_as_recorded(parent, tmp_path):
    """req-2 goes greedy from position 3: it stops taking random numbers. Unseeded req-3 shares
    torch's global generator with it, so without the recorded draws req-3 would take the numbers
    req-2 used to take and its text would change."""
    tokens = _tokens(parent)
    out = tmp_path / "greedy.wbtrace"
    result = workbench.fork(str(parent), "req-2:3", changes=["temperature=0"], out=str(out))
    forked = _tokens(out)
    assert result.mode == EXACT
    assert forked["req-2"][:3] == tokens["req-2"][:3]
    assert all(forked[r] == tokens[r] for r in tokens if r != "req-2")


def test_a_parent_without_recorded_draws_is_forked_as_a_re_fed_prefix(tiny, tmp_path):
    path, out = tmp_path / "p.wbtrace", tmp_path / "f.wbtrace"
    with Engine(tiny, trace=str(path), trace_topk=0) as engine:  # no sampling records: no draws
        engine.generate(PROMPTS[:2], [_params(0), _params(2)])
    assert _draws(path) == {}
    tokens = _tokens(path)
    result = workbench.fork(str(path), "req-1:5", token=tokens["req-1"][5], out=str(out))
    assert result.mode == REFED and "re-fed" in result.describe()
    assert _tokens(out)["req-1"][:5] == tokens["req-1"][:5]
