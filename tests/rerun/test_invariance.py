"""Batch invariance: each recorded request re-run alone and in its recorded batch of 16, compared per
position (logprob drift of the same token, first differing token, near tie or not)."""

from __future__ import annotations

import pytest

from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.invariance import invariance

PROMPTS = [f"Note {i}: the committee met on day {i} to discuss {'budgets' if i % 2 else 'harbours'} and weather"
           for i in range(16)]
N = 8


def _record(model, path, device="cpu", dtype=None, unseeded: int | None = None):
    params = [SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=None if i == unseeded else i, max_new_tokens=N, ignore_eos=True)
              for i in range(16)]
    with Engine(model, device=device, dtype=dtype, trace=str(path)) as engine:
        engine.generate(PROMPTS, params)
    return path


@pytest.mark.slow
def test_sixteen_requests_alone_vs_batched(tiny, tmp_path, capsys):
    path = _record(tiny, tmp_path / "sixteen.wbtrace", unseeded=4)
    report = invariance(str(path))
    assert len(report.requests) == 16
    assert all(max(r.batch_sizes) > 1 for r in report.requests)  # they really shared forwards
    seeded = [r for r in report.requests if r.seeded]
    assert len(seeded) == 15 and not report.request("req-4").seeded
    assert all(r.identical and len(r.positions) == N for r in seeded)  # CPU fp32: the same tokens alone
    assert report.max_delta < 1e-3
    with capsys.disabled():  # the figure for the record, shown with -s
        print(f"\nmax |dlogprob| alone vs batched, 16 requests x {N} tokens (tiny-random, CPU fp32): "
              f"{report.max_delta:.2e}")
    text = report.describe()
    assert "15/16" in text or "16/16" in text
    assert "sampled without a seed" in text
    assert cli_main(["invariance", str(path), "--request", "req-3"]) == 0
    out = capsys.readouterr().out
    assert "req-3, per position:" in out and len(out.split("req-3, per position:")[1].strip().splitlines()) == N + 1


def test_unknown_request_is_a_clear_error(tiny, tmp_path, capsys):
    path = tmp_path / "one.wbtrace"
    with Engine(tiny, trace=str(path)) as engine:
        engine.generate(["hello there"], SamplingParams(temperature=0, max_new_tokens=2))
    assert cli_main(["invariance", str(path), "--request", "req-9"]) == 2
    assert "no recorded request 'req-9'" in capsys.readouterr().err


@pytest.mark.gpu
def test_invariance_on_cuda_bf16(tiny, tmp_path):
    path = _record("tiny-random", tmp_path / "cuda.wbtrace", device="cuda", dtype="bfloat16")
    report = invariance(str(path))
    assert report.device.startswith("cuda") and "bfloat16" in report.dtype
    assert all(len(r.positions) > 0 for r in report.requests)
    assert all(r.verdict is not None for r in report.requests if r.first_diff is not None)
    print(f"\nCUDA bf16: {sum(r.identical for r in report.requests)}/16 identical, max |dlogprob| "
          f"{report.max_delta:.2e}")
    print(report.describe())


@pytest.mark.slow
def test_the_flip_risk_map_puts_the_positions_a_drift_could_flip_first(tiny, tmp_path, capsys):
    """fast-int8 on the CPU: a batch of more than 8 rows takes another GEMM kernel than a request
    alone, so tokens drift between the two contexts. Each compared position carries drift / top-2
    margin; the map lists the highest first, and a token that flipped sits at a position whose risk
    is high (the drift there reached the margin)."""
    from workbench.trace.invariance_store import read_invariance

    path = tmp_path / "int8.wbtrace"
    with Engine(tiny, trace=str(path), kernels="fast-int8") as engine:
        engine.generate(PROMPTS[:10], SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True))
    report = invariance(str(path))
    cells = report.risk_map()
    risks = [p.risk for _, p in cells]
    assert cells and risks == sorted(risks, reverse=True)
    assert all(p.drift is not None and p.margin is not None for _, p in cells)
    assert any(p.drift > 0 for _, p in cells)  # bf16: the contexts do differ
    summary = report.risk_summary()
    flips = [r.positions[r.first_diff] for r in report.requests if r.first_diff is not None and r.seeded]
    assert summary["flips"] == len(flips)
    assert all(p.risk is not None and p.risk >= 0.5 for p in flips)  # a flip is where drift met the margin
    assert cli_main(["invariance", str(path)]) == 0
    out = capsys.readouterr().out
    assert "flip risk" in out and f"{summary['above_1']} of {summary['positions']} positions above 1" in out
    from workbench.notebook.whatif import InvarianceView

    page = InvarianceView(report).html()
    top_rid, top = cells[0]
    assert page.index("flip risk") < page.index(f"<h4>{top_rid}</h4>")  # the map comes before the tables
    stored_summary, rows = read_invariance(str(path))
    assert stored_summary["flip_risk"] == summary
    assert all("risk" in p for row in rows.values() for p in row["positions"])


def test_the_flip_risk_map_has_a_column_per_context(tiny, tmp_path, capsys):
    """Beside alone, chunked prefill, a prefix-cache hit and speculation toggled are each re-run and
    compared with the recorded batch: each is a column of the map, a position's drift is the largest
    of them, and the stored rows keep every column."""
    from workbench.trace.invariance_store import read_invariance

    path = _record(tiny, tmp_path / "contexts.wbtrace")
    contexts = ["chunked:4", "prefix-cache", "speculative"]
    report = invariance(str(path), req_ids=["req-0", "req-1", "req-3"], contexts=contexts)
    assert report.contexts == ["alone", *contexts]
    greedy, sampled = report.request("req-1"), report.request("req-0")
    for c in ("alone", "chunked:4", "prefix-cache"):  # another computation each: some drift somewhere
        assert any((p.drifts.get(c) or 0) > 0 for r in report.requests for p in r.positions), c
    assert all(isinstance(p.drifts["speculative"], float) for p in greedy.positions)  # compared at every position
    assert all("speculative" not in p.drifts for p in sampled.positions)  # its verify steps draw other numbers
    assert all(set(p.drifts) == set(report.contexts) for p in greedy.positions)
    for r in report.requests:
        for p in r.positions:
            assert p.drift == max(d for d in p.drifts.values() if d is not None)
            assert p.risk == pytest.approx(p.drift / p.margin)
    assert set(report.risk_summary()["flips_by_context"]) == set(report.contexts)
    assert cli_main(["invariance", str(path), "--request", "req-1", "--context", "chunked:4", "--context",
                     "speculative"]) == 0
    out = capsys.readouterr().out
    assert "batched vs alone, chunked:4, speculative" in out and "flips by context: alone 0" in out
    head = next(line for line in out.splitlines() if line.startswith("request ") and "risk" in line)
    assert "chunked:4" in head and "speculative" in head
    summary, rows = read_invariance(str(path))
    assert summary["contexts"] == ["alone", "chunked:4", "speculative"]
    assert set(rows["req-1"]["positions"][0]["drifts"]) == {"alone", "chunked:4", "speculative"}
    assert cli_main(["invariance", str(path), "--context", "chunked:x"]) == 2
    assert "chunked:N needs N an int" in capsys.readouterr().err
