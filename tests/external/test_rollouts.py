"""The noise floor, resend and imported rollouts, on the CPU with the tiny reference (no peer engine).

What a user relies on: a floor measured from two runs is saved, read back (and a damaged file is
refused), and moves a check's or a diff's verdict from near tie / real to "inside the floor" only
where the engine's own noise explains it, while every table shows the floor beside the figures;
`resend` reads back exactly the requests a trace sent; `import` reads TRL-, verl- and vLLM-shaped
rollouts (JSONL, Parquet, RequestOutput objects) within its limits, and `check` then counts the
tokens truncated / masked importance sampling would clip or drop, with the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workbench.external.check import check_trace
from workbench.external.floor import Floor, FloorBand, floor_from_traces, load_floor
from workbench.external.importance import Thresholds
from workbench.external.imports import import_generations, import_request_outputs, read_rollouts
from workbench.trace.checks import read_checks
from workbench.trace.diff import diff_traces
from workbench.trace.diff_format import format_report
from workbench.trace.events import RequestAdded, RequestFinished, TokenChosen
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter

pytestmark = pytest.mark.slow  # one tiny reference engine (seconds); each test is well under a second after it

PROMPTS = ["The capital of France is", "Once upon a time", "List three fruits:", "def add(a, b):"]


def _cli(*argv: str) -> tuple[int, str]:
    from workbench.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def _write(path: Path, requests: list[tuple[str, list[tuple[int, float, list[list[Any]]]]]],
           params: dict[str, Any] | None = None) -> Path:
    """A probe-shaped trace: per request (id, [(token, logprob, top), ...])."""
    with TraceWriter(path, {"source": "external"}) as w:
        for n, (rid, toks) in enumerate(requests):
            w.write(RequestAdded(step=n, req_id=rid, t=0.0, prompt=f"prompt {n}", prompt_ids=[1, 2, 3],
                                 params={"temperature": 0.0, "max_tokens": 8, "greedy": True, **(params or {})}))
            for i, (tid, lp, top) in enumerate(toks):
                w.write(TokenChosen(step=n, req_id=rid, t=0.0, position=i, token_id=tid, text=f"t{tid}", logprob=lp,
                                    top_logprobs=top))
            w.write(RequestFinished(step=n, req_id=rid, t=0.0, output_ids=[t for t, _, _ in toks]))
    return path


def _run(shift: float, flip_at: int | None = None) -> list[tuple[str, list[tuple[int, float, list[list[Any]]]]]]:
    """Four requests of 30 greedy tokens; logprobs moved by `shift` (alternating sign); request r2
    takes its runner-up at `flip_at` (top-2 margin 0.02)."""
    reqs = []
    for r in range(4):
        toks = []
        for i in range(30):
            lp = -0.05 * (i % 7) - 0.001 + (shift if i % 2 else -shift) * (i % 3 == 0)
            top = [[10 + i, lp, "a"], [50 + i, lp - 0.02, "b"], [90 + i, -6.0 + shift, "c"]]
            tid = 10 + i
            if r == 2 and flip_at == i:
                tid, lp = 50 + i, lp - 0.02
            toks.append((tid, lp, top))
        reqs.append((f"r{r}", toks))
    return reqs


@pytest.fixture(scope="module")
def engine():
    from workbench.engine.engine import Engine

    return Engine("tiny-random", trace=None, trace_level="off")


# --- the floor ------------------------------------------------------------------------------------


def test_a_floor_measured_from_two_runs_is_saved_read_back_and_damage_is_refused(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.wbtrace", _run(0.0))
    b = _write(tmp_path / "b.wbtrace", _run(0.003, flip_at=12))
    floor = floor_from_traces(a, b, {"url": "http://x"})
    # r2 flips at 12: its positions after it are not compared; the flip's margin is A's preference
    assert floor.positions == 3 * 30 + 12 and floor.flips == 1
    assert floor.flip_margins == [pytest.approx(0.02)]
    assert floor.max_abs == pytest.approx(0.003) and floor.identical_positions > 0
    assert floor.bound(-0.1) == pytest.approx(0.003)  # a band with figures
    assert floor.bound(-20.0) == floor.max_abs  # a band without: the overall max
    assert floor.flip_bound(-0.1) == pytest.approx(max(0.006, 0.02))
    path = floor.save(tmp_path / "floor.json")
    assert load_floor(path).summary() == floor.summary()
    code, text = _cli("floor", "--traces", str(a), str(b), "--out", str(tmp_path / "f2.json"))
    assert code == 0 and "argmax flips        1 request(s)" in text and (tmp_path / "f2.json").exists()
    for bad, why in [("{", "not JSON"), ('{"format": "x"}', "not a floor file"),
                     (json.dumps({**floor.to_json(), "flips": -1}), "count >= 0"),
                     (json.dumps({**floor.to_json(), "version": 9}), "version")]:
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_floor(tmp_path / "bad.json")
    (tmp_path / "big.json").write_text(" " * (2 << 20))
    with pytest.raises(ValueError, match="not a floor file"):
        load_floor(tmp_path / "big.json")


def test_diff_names_each_differing_request_and_a_flip_inside_the_floor_is_not_real(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.wbtrace", _run(0.0))
    b = _write(tmp_path / "b.wbtrace", _run(0.01, flip_at=5))
    with open_trace(a) as ta, open_trace(b) as tb:
        plain = format_report(diff_traces(ta, tb, tolerance=0.01))
        wide = Floor([FloorBand(0.0, math.inf, 100, 100, 0.02)], 4, 100, 1, [0.05], 0, {"url": "http://x"})
        floored = diff_traces(ta, tb, tolerance=0.01, floor=wide)
    assert "requests that differ: 1 of 4" in plain and "r2 position 5" in plain
    assert "a real difference (top-2 margin 0.02" in plain and "floor: none measured" in plain
    text = format_report(floored)
    assert "r2 position 5" in text and "inside the floor (top-2 margin 0.02" in text
    assert "floor: measured at http://x" in text and floored.request("r0").beyond_floor == 0
    Floor([FloorBand(0.0, math.inf, 100, 100, 0.02)], 4, 100, 1, [0.05], 0, {"url": "http://x"}).save(tmp_path / "f.json")
    code, out = _cli("diff", str(a), str(b), "--floor", str(tmp_path / "f.json"))
    assert code == 1 and "inside the floor" in out
    # a sampled request's different draw is no near-tie question, floor or not
    sa = _write(tmp_path / "sa.wbtrace", _run(0.0), {"temperature": 0.8, "greedy": False})
    sb = _write(tmp_path / "sb.wbtrace", _run(0.01, flip_at=5), {"temperature": 0.8, "greedy": False})
    with open_trace(sa) as ta, open_trace(sb) as tb:
        text = format_report(diff_traces(ta, tb, tolerance=0.01, floor=wide))
    assert "r2 position 5" in text and "sampled (the runs drew different tokens" in text
    assert "inside the floor (" not in text


def test_check_with_a_floor_calls_a_flip_the_engine_makes_itself_inside_the_floor(engine, tmp_path: Path) -> None:
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path / "own.wbtrace"
    from workbench.engine.engine import Engine

    with Engine("tiny-random", trace=str(path)) as eng:
        eng.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=10, logprobs=True, top_logprobs=5,
                                                 ignore_eos=True))
    swapped = tmp_path / "swapped.wbtrace"
    with open_trace(path) as trace, TraceWriter(swapped, {"model": trace.meta.get("model")}) as out:
        for info in trace.requests():
            out.write(info.added)
            for tok in trace.timeline(info.req_id).tokens:
                if tok.position == 9 and info.req_id == trace.requests()[0].req_id:  # the last: nothing follows
                    tok = TokenChosen(step=tok.step, req_id=tok.req_id, t=tok.t, position=9,
                                      token_id=int(tok.top_logprobs[1][0]), text="x", logprob=tok.top_logprobs[1][1],
                                      top_logprobs=tok.top_logprobs)
                out.write(tok)
            out.write(info.finished)
    plain = check_trace(swapped, "tiny-random", engine=engine, tolerance=0.0, store=False, progress=False)
    first = plain.requests[0]
    gap = first.positions[9].gap
    assert first.divergence_class == "real" and gap > 0
    assert "floor             none measured: constant tolerance 0" in plain.render()
    floor = Floor([FloorBand(0.0, math.inf, 50, 50, 1e-9)], 2, 50, 1, [gap * 1.01], 0, {"url": "http://vllm"})
    floored = check_trace(swapped, "tiny-random", engine=engine, tolerance=0.0, floor=floor, progress=False)
    assert floored.requests[0].divergence_class == "floor" and floored.exit_code == 0
    table = floored.render()
    assert "floor             measured at http://vllm" in table and "inside the floor  1 greedy flips" in table
    assert "(floor: the engine's own, up to 1e-09)" in table
    stored = read_checks(swapped)[first.req_id]["positions"][9]
    assert stored["verdict"] == "floor" and stored["floor"] == pytest.approx(1e-9)
    from tui.widgets.reference import verdict_text
    from workbench.notebook.viewer import TraceViewer

    assert verdict_text(stored) == "≈ inside the engine's noise floor"  # the TUI's tokens pane
    fig = TraceViewer(str(swapped), req_id=first.req_id, widgets=False).figures["reference"]
    assert list(next(t for t in fig.data if t.name == "inside the noise floor").x) == [9]
    tight = Floor([FloorBand(0.0, math.inf, 50, 50, 1e-9)], 2, 50, 1, [gap * 0.5], 0, {"url": "http://vllm"})
    again = check_trace(swapped, "tiny-random", engine=engine, tolerance=0.0, floor=tight, store=False, progress=False)
    assert again.requests[0].divergence_class == "real"  # beyond what the engine does to itself


# --- resend ---------------------------------------------------------------------------------------


def test_resend_reads_back_each_request_as_it_was_sent(tmp_path: Path) -> None:
    from workbench.external.resend import parse_set, recorded_requests

    path = tmp_path / "probe.wbtrace"
    with TraceWriter(path, {"source": "external", "external": {"top_logprobs": 7, "max_tokens": 9},
                            "reference": {"tokenizer": "smollm2"}}) as w:
        w.write(RequestAdded(step=0, req_id="a", t=0.0, prompt="Hello", prompt_ids=[1],
                             params={"temperature": 0.8, "seed": 3, "top_p": 0.9, "max_tokens": 9, "logprobs": 7,
                                     "endpoint": "completions", "greedy": False}))
        w.write(RequestAdded(step=0, req_id="b", t=0.0, prompt=[{"role": "user", "content": "Hi"}], prompt_ids=[1],
                             params={"temperature": 0.0, "stop": ["\n"], "max_tokens": 9}))
        w.write(RequestAdded(step=0, req_id="c", t=0.0, prompt=None, prompt_ids=[1, 2], params={}))
    rec = recorded_requests(path)
    assert rec.req_ids == ["a", "b"] and "c" in rec.skipped
    assert rec.requests[0].prompt == "Hello" and rec.requests[0].params == {"temperature": 0.8, "seed": 3,
                                                                            "top_p": 0.9, "max_tokens": 9}
    assert rec.requests[1].messages == [{"role": "user", "content": "Hi"}] and rec.requests[1].params["stop"] == ["\n"]
    assert (rec.top_logprobs, rec.max_tokens, rec.tokenizer) == (7, 9, "smollm2")
    assert parse_set(["repeat_penalty=1.0", "stop=[\"x\"]"]) == {"repeat_penalty": 1.0, "stop": ["x"]}
    with pytest.raises(ValueError, match="FIELD one of"):
        parse_set(["api_key=1"])


# --- imports --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollouts(engine) -> dict[str, Any]:
    """Sampled generations of the reference itself (raw logprobs), and one at temperature 0.5 whose
    logprobs are processed (after temperature), as an RL engine in processed mode reports them."""
    from workbench.engine.sample.sampling_params import SamplingParams

    raw = engine.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=7 + i, max_new_tokens=12, logprobs=True,
                                                   top_logprobs=3, ignore_eos=True) for i in range(4)])
    hot = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.5, seed=1, max_new_tokens=12, logprobs=True,
                                                      logprobs_mode="processed", ignore_eos=True))
    return {"raw": raw, "hot": hot[0]}


def _lps(out: Any) -> list[float]:
    return [t.logprob for t in out.logprobs]


def test_trl_and_verl_rollouts_import_and_check_counts_what_tis_and_mis_would_do(engine, rollouts, tmp_path) -> None:
    raw = rollouts["raw"]
    # TRL's batched shape, one row: prompt_ids / completion_ids / logprobs; one of r0's tokens overrated by
    # the engine (w = e^-1: MIS drops it), r1's token 5 underrated (w = e: TIS clips, MIS drops)
    lps = [_lps(o) for o in raw]
    low = min(range(12), key=lambda i: lps[0][i])  # the least likely token sampled: room to overrate it
    assert lps[0][low] < -1.0
    lps[0][low] += 1.0
    lps[1][5] -= 1.0
    moved = {(0, low): 1.0, (1, 5): -1.0}
    trl = {"prompt_ids": [o.prompt_token_ids for o in raw[:2]], "completion_ids": [o.token_ids for o in raw[:2]],
           "logprobs": lps[:2], "temperature": 1.0}
    # verl's: prompts / responses right-padded with response_mask / rollout_log_probs
    verl = [{"uid": "v", "prompts": o.prompt_token_ids, "responses": o.token_ids + [0, 0],
             "response_mask": [1] * len(o.token_ids) + [0, 0], "rollout_log_probs": lps[i] + [0.0, 0.0]}
            for i, o in zip((2, 3), raw[2:])]
    src = tmp_path / "rollouts.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [trl, *verl]) + "\n")
    code, text = _cli("import", str(src), "--out", str(tmp_path / "r.wbtrace"), "--tokenizer", "tiny-random")
    assert code == 0 and "4 rollouts, 48 output tokens" in text
    report = check_trace(tmp_path / "r.wbtrace", "tiny-random", engine=engine, progress=False)
    imp = report.importance
    assert imp is not None and imp.tokens == 48
    # every unmoved token's ratio is 1 (the reference's own logprobs); the moved ones are off by their shift
    by = {(i, p.position): p for i, r in enumerate(report.requests) for p in r.positions}
    for key, p in by.items():
        want = -moved.get(key, 0.0)
        assert p.log_ratio == pytest.approx(want, abs=1e-4), key
    expect_drop = sum(1 for d in moved.values() if abs(d) > math.log(2))
    expect_clip = sum(1 for d in moved.values() if -d > math.log(2))
    assert (imp.dropped, imp.clipped) == (expect_drop, expect_clip) and imp.dropped >= 1
    assert sum(imp.reasons.values()) == len([d for d in moved.values() if abs(d) > math.log(2)])
    table = report.render()
    assert "TIS (cap C=2)" in table and f"{imp.clipped} tokens clipped" in table and "MIS [0.5, 2]" in table
    # thresholds are the user's: a cap of 3 clips nothing here
    loose = check_trace(tmp_path / "r.wbtrace", "tiny-random", engine=engine, store=False, progress=False,
                        importance=Thresholds(tis_cap=3.0, mis_low=0.1, mis_high=3.0))
    assert loose.importance.clipped == 0 and loose.importance.dropped == 0
    # Parquet, same rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "r.parquet")
    got = list(read_rollouts(tmp_path / "r.parquet"))
    assert [r.req_id for r in got] == ["v", "v"] and got[0].output_ids == raw[2].token_ids
    with open_trace(tmp_path / "r.wbtrace") as trace:  # verl's shared uid: each sample stays its own request
        assert [i.req_id for i in trace.requests()][-2:] == ["v", "v#2"]


def test_request_outputs_import_duck_typed_with_their_top_logprobs(engine, rollouts, tmp_path) -> None:
    out = rollouts["hot"]
    outputs = [SimpleNamespace(request_id="hot", prompt=PROMPTS[0], prompt_token_ids=out.prompt_token_ids,
                               outputs=[SimpleNamespace(token_ids=out.token_ids, finish_reason="length",
                                                        logprobs=[{t.token_id: SimpleNamespace(logprob=t.logprob),
                                                                   t.token_id + 1: SimpleNamespace(logprob=-30.0)}
                                                                  for t in out.logprobs])])]
    res = import_request_outputs(outputs, tmp_path / "hot.wbtrace", params={"temperature": 0.5}, tokenizer=None,
                                 logprobs_mode="processed")
    assert res.rows == 1 and res.tokens == 12
    with open_trace(tmp_path / "hot.wbtrace") as trace:
        assert trace.meta["import"]["logprobs_mode"] == "processed"
        (info,) = trace.requests()
        assert info.added.params["temperature"] == 0.5 and not info.added.params["greedy"]
        toks = trace.timeline("hot").tokens
    assert [t.token_id for t in toks] == out.token_ids
    assert [t.logprob for t in toks] == pytest.approx([t.logprob for t in out.logprobs])
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0][0] == t.token_id for t in toks)
    report = check_trace(tmp_path / "hot.wbtrace", "tiny-random", engine=engine, store=False, progress=False)
    assert report.importance is not None and report.importance.tokens == 12


def test_the_reason_for_a_clipped_token_names_processed_logprobs_low_probability_or_a_near_tie() -> None:
    from workbench.external.importance import classify_ratio, processed_logprob

    top = [(1, math.log(0.6)), (2, math.log(0.3)), (3, math.log(0.1))]
    hot = processed_logprob(top, 3, 0.5, 1.0, -1)  # 0.1^2 / (0.36 + 0.09 + 0.01)
    assert hot == pytest.approx(math.log(0.01 / 0.46))
    assert processed_logprob(top, 3, 1.0, 0.85, -1) is None  # top-p 0.85 keeps tokens 1 and 2
    t = Thresholds()
    v = classify_ratio(hot, math.log(0.1), thresholds=t, ref_processed=hot, ref_margin=0.7, rank=3, tolerance=0.05)
    assert (v.tis, v.mis, v.reason) == ("clip", "drop", "processed")
    v = classify_ratio(math.log(0.001), math.log(0.004), thresholds=t, ref_processed=None, ref_margin=1.0, rank=9,
                       tolerance=0.05)
    assert (v.tis, v.mis, v.reason) == ("clip", "drop", "low_prob")
    v = classify_ratio(math.log(0.2), math.log(0.45), thresholds=t, ref_processed=None, ref_margin=0.01, rank=2,
                       tolerance=0.05)
    assert v.reason == "near_tie"
    v = classify_ratio(-0.3, -0.31, thresholds=t, ref_processed=None, ref_margin=0.01, rank=2, tolerance=0.05)
    assert (v.tis, v.mis, v.reason) == (None, None, None)


def test_untrusted_rollout_files_are_refused_with_the_row_and_the_limit(tmp_path: Path, monkeypatch) -> None:
    good = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-0.1, -0.2]}

    made: list[Path] = []

    def rows(*objs: Any) -> Path:
        p = tmp_path / f"x{len(made)}.jsonl"
        made.append(p)
        p.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n")
        return p

    cases = [
        (rows(good, good, good), {"max_rows": 2}, "max_rows=2"),
        (rows({**good, "completion_ids": [3, 4] * 10, "logprobs": [-0.1] * 20}), {"max_tokens": 8}, "max_tokens=8"),
        (rows(good, {**good, "completion_ids": ["a", 4]}), {}, "line 2: completion_ids holds 'a'"),
        (rows({**good, "logprobs": [-0.1]}), {}, "one logprob per output id"),
        (rows({**good, "logprobs": [0.5, -0.1]}), {}, "logprobs are finite numbers <= 0"),
        (rows({"completion_ids": [1]}), {}, "no prompt ids"),
        (rows({"prompt_ids": [1], "completion_ids": [1]}), {}, "no per-token logprobs"),
        (rows("{not json"), {}, "line 1 is not JSON"),
    ]
    for path, kw, why in cases:
        with pytest.raises(ValueError, match=why):
            list(read_rollouts(path, **kw))
    assert import_generations(rows(good), tmp_path / "ok.wbtrace", tokenizer=None).tokens == 2
    monkeypatch.setattr("workbench.external.imports.MAX_LINE_BYTES", 64)
    with pytest.raises(ValueError, match="over 64 bytes"):
        list(read_rollouts(rows({**good, "completion_ids": list(range(40)), "logprobs": [-0.1] * 40})))
    code = _cli("import", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.wbtrace"))[0]
    assert code == 2
    with pytest.raises(ValueError, match="mis_low must be below mis_high"):
        Thresholds(mis_low=2.0, mis_high=1.0)
