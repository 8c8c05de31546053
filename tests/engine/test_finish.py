"""Finish decisions: one row per rule of DESIGN.md's order, and the evidence a trace shows."""

from __future__ import annotations

from typing import Any

import pytest

from workbench.engine.output.finish import FinishInputs, decide_finish, stops_by_token
from workbench.trace.events import FinishDecision, event_loads

EOS, STOP_ID, OTHER = 2, 7, 100


def inputs(**kw: Any) -> FinishInputs:
    base: dict[str, Any] = dict(num_output_tokens=5, max_new_tokens=10, seq_len=20, context_limit=100,
                                last_token_id=OTHER, eos_token_ids=(EOS,), stop_token_ids=())
    base.update(kw)
    return FinishInputs(**base)


# (case, inputs, finish_reason, evidence, matched_stop)
ROWS = [
    ("running", {}, None, None, None),
    ("abort", dict(aborted="client disconnected", last_token_id=EOS), "abort",
     {"type": "abort", "message": "client disconnected"}, None),
    ("length by max_new_tokens", dict(num_output_tokens=10), "length",
     {"type": "length", "length": 10, "cause": "max_new_tokens"}, None),
    ("length by context", dict(seq_len=100), "length", {"type": "length", "length": 5, "cause": "context"}, None),
    ("EOS exactly at max_new_tokens is length", dict(num_output_tokens=10, last_token_id=EOS), "length",
     {"type": "length", "length": 10, "cause": "max_new_tokens"}, None),
    ("EOS", dict(last_token_id=EOS), "stop", {"type": "stop", "matched": EOS}, EOS),
    ("EOS before min_new_tokens", dict(num_output_tokens=3, min_new_tokens=3, last_token_id=EOS), None, None, None),
    ("EOS right after min_new_tokens", dict(num_output_tokens=4, min_new_tokens=3, last_token_id=EOS), "stop",
     {"type": "stop", "matched": EOS}, EOS),
    ("ignore_eos with EOS", dict(ignore_eos=True, last_token_id=EOS), None, None, None),
    ("ignore_eos keeps stop_token_ids", dict(ignore_eos=True, stop_token_ids=(STOP_ID,), last_token_id=STOP_ID),
     "stop", {"type": "stop", "matched": STOP_ID}, STOP_ID),
    ("stop string", dict(stop_string_matched="###"), "stop", {"type": "stop", "matched": "###"}, "###"),
    ("stop string before min_new_tokens", dict(stop_string_matched="###", min_new_tokens=5), None, None, None),
    ("tool_calls replaces stop", dict(last_token_id=EOS, has_complete_tool_call=True), "tool_calls",
     {"type": "tool_calls", "matched": EOS}, EOS),
    ("tool_calls never replaces length", dict(num_output_tokens=10, last_token_id=EOS, has_complete_tool_call=True),
     "length", {"type": "length", "length": 10, "cause": "max_new_tokens"}, None),
    ("a complete tool call alone does not stop", dict(has_complete_tool_call=True), None, None, None),
    ("no max_new_tokens: only the context limits", dict(max_new_tokens=None, num_output_tokens=10_000), None,
     None, None),
]


@pytest.mark.parametrize(("case", "kw", "reason", "evidence", "matched"), ROWS, ids=[r[0] for r in ROWS])
def test_finish_decision_table(case: str, kw: dict[str, Any], reason: str | None, evidence: Any,
                               matched: Any) -> None:
    res = decide_finish(inputs(**kw))
    assert (res.finish_reason, res.evidence, res.matched_stop) == (reason, evidence, matched)
    assert res.finished == (reason is not None)


def test_every_check_is_recorded_in_order() -> None:
    res = decide_finish(inputs(num_output_tokens=10, last_token_id=EOS))
    names = [c["name"] for c in res.checks]
    assert names == ["abort", "max_new_tokens", "context_full", "before_min_new_tokens", "eos_token",
                     "stop_token_ids", "stop_string", "tool_calls"]
    fired = {c["name"] for c in res.checks if c["result"]}
    assert fired == {"max_new_tokens", "eos_token"}  # the trace shows EOS fired, and length won
    eos = next(c for c in res.checks if c["name"] == "eos_token")
    assert eos["inputs"] == {"token_id": EOS, "eos_token_ids": [EOS], "ignore_eos": False}


def test_why_it_did_not_stop_is_visible() -> None:
    res = decide_finish(inputs(num_output_tokens=2, min_new_tokens=4, last_token_id=EOS))
    by_name = {c["name"]: c for c in res.checks}
    assert res.finish_reason is None
    assert by_name["before_min_new_tokens"]["result"] is True
    assert by_name["eos_token"]["result"] is False


def test_result_becomes_a_finish_decision_trace_event() -> None:
    res = decide_finish(inputs(stop_string_matched="</s>", has_complete_tool_call=True))
    ev = FinishDecision(step=9, req_id="r", **res.trace_fields())
    back = event_loads(ev.dumps())
    assert back == ev and back.finish_reason == "tool_calls" and back.evidence == {"type": "tool_calls",
                                                                                  "matched": "</s>"}


def test_stopped_by_token_tells_the_engine_to_leave_its_text_out() -> None:
    assert decide_finish(inputs(last_token_id=EOS)).stopped_by_token
    assert not decide_finish(inputs(stop_string_matched="x")).stopped_by_token


@pytest.mark.parametrize(("field", "value"), [("num_output_tokens", -1), ("max_new_tokens", 0),
                                              ("context_limit", 0), ("min_new_tokens", -2)])
def test_bad_inputs_name_the_parameter(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        inputs(**{field: value})


def test_the_quick_stop_by_token_answer_is_the_full_decisions() -> None:
    """The detokenizer's per-token question (stopped by a token id?) answered without the recorded
    checks agrees with the full decision on every combination of the rules' inputs."""
    import itertools

    seen = set()
    for n, mx, seq, mn, tok, ign, stop_ids, stop_str, tool, abort in itertools.product(
            (1, 4, 10), (None, 10), (20, 100), (0, 4), (None, EOS, STOP_ID, OTHER), (False, True),
            ((), (STOP_ID,), (EOS,)), (None, "###"), (False, True), (None, "gone")):
        inp = inputs(num_output_tokens=n, max_new_tokens=mx, seq_len=seq, min_new_tokens=mn, last_token_id=tok,
                     ignore_eos=ign, stop_token_ids=stop_ids, stop_string_matched=stop_str,
                     has_complete_tool_call=tool, aborted=abort)
        want = decide_finish(inp).stopped_by_token
        assert stops_by_token(inp) == want, inp
        seen.add(want)
    assert seen == {True, False}
