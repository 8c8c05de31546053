"""The GEMM fast paths (MKL's packed sgemm and the split GEMM for decode batches): each gives
`F.linear`'s bits on whatever CPU runs it or is refused for that shape and row count, the fastest
identical entrant of a timed race runs, verdicts and races are reused from disk, and the engine
reports which kernel ran and why."""

from __future__ import annotations

import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.run import cpu_kernels, fastpath
from workbench.engine.run.fastpath import FastPathChecks
from workbench.engine.sample.sampling_params import SamplingParams


def _linear_stack(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 200, bias=False), torch.nn.Linear(200, 64, bias=True)).eval()


NO_MKL = "PACKED GEMM NOT CHECKED: this torch has no MKL packed sgemm"


def _count_calls(monkeypatch, method: str = "compute") -> list[int]:
    """The row counts of every call to PackedLinear.`method` (compute: packed, split_compute: split)."""
    calls: list[int] = []
    compute = getattr(cpu_kernels.PackedLinear, method)

    def counted(self, x2):
        calls.append(x2.shape[0])
        return compute(self, x2)

    monkeypatch.setattr(cpu_kernels.PackedLinear, method, counted)
    return calls


@pytest.fixture
def packed_only(monkeypatch):
    """No split GEMM: the packed GEMM alone, as on one thread or where every split is refused."""
    monkeypatch.setattr(cpu_kernels, "SPLIT_MAX_ROWS", 0)


def _fixed_race(monkeypatch, ms: dict[str, float]) -> list[str]:
    """The race as if each entrant took `ms[kind]` (nothing is run: which kernel wins on this CPU
    is not what the calling test is about). Returns the entrants timed, in order."""
    timed: list[str] = []

    def fake(kind, fn, x):
        timed.append(kind)
        return ms[kind] / 1e3

    monkeypatch.setattr(FastPathChecks, "_time", staticmethod(fake))
    return timed


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test (the split GEMM needs two or more); restored after."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


@pytest.fixture
def kernels_win(monkeypatch):
    """Every identical kernel wins the race against F.linear (the split one first), as on the AMD
    EPYC these kernels were measured on."""
    _fixed_race(monkeypatch, {fastpath.SPLIT: 1.0, fastpath.PACKED: 2.0, fastpath.LINEAR: 3.0})


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 100, 200])
def test_packed_linears_give_exactly_what_f_linear_gives(rows, monkeypatch, packed_only, kernels_win):
    # On any CPU: the output is F.linear's bit for bit (greedy parity with transformers relies on
    # it). The packed GEMM runs only at the row counts this CPU's check found identical.
    calls = _count_calls(monkeypatch)
    checks = FastPathChecks()
    plain, packed = _linear_stack(0), _linear_stack(0)
    assert cpu_kernels.pack_linears(packed, checks=checks) > 0
    assert all(isinstance(m.forward, cpu_kernels.PackedLinear) for m in packed)
    x = torch.randn(2, rows, 96) * 4
    n = 2 * rows
    with torch.inference_mode():
        ready = [m.forward.packed is not None for m in packed]  # packed at load by the check itself
        assert torch.equal(packed(x), plain(x))
        first = calls.count(n)
        assert torch.equal(packed(x * 2), plain(x * 2))
    verdicts = {(k[0], k[1]): v.identical for k, v in checks.linear.items() if k[3] == n and k[5] == "packed"}
    if not cpu_kernels.PACKED_MIN_ROWS <= n <= cpu_kernels.PACKED_MAX_ROWS:
        assert not verdicts and n not in calls  # outside the packed range nothing is packed, nothing checked
    else:
        assert set(verdicts) == {(200, 96), (64, 200)}  # both shapes checked at exactly these rows
        # each shape's check computed once at n rows; the first forward used the packed GEMM iff
        # identical and already packed (packing may never pay off), the second iff identical
        ok = [verdicts[(m.out_features, m.in_features)] for m in packed]
        assert first == len(verdicts) + sum(o and r for o, r in zip(ok, ready, strict=True))
        assert calls.count(n) == first + sum(ok)
    with torch.inference_mode():
        assert torch.equal(packed(x[:, ::2]), plain(x[:, ::2]))  # a strided input is made contiguous first


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 40, 64])
def test_split_gemms_for_decode_batches_give_exactly_what_f_linear_gives(rows, threads, monkeypatch, kernels_win,
                                                                          torch_threads):
    # On any CPU: 1-64 rows (decode batches) come out as F.linear's bits, and the split GEMM ran
    # exactly for the shapes this CPU's check found identical (with 3 threads, 64 output rows do
    # not split in three: not split, not checked).
    calls = _count_calls(monkeypatch, "split_compute")
    torch_threads(threads)
    checks = FastPathChecks()
    plain, split = _linear_stack(6), _linear_stack(6)
    assert cpu_kernels.pack_linears(split, checks=checks) > 0
    at_load = {(k[0], k[1]) for k in checks.linear if k[5] == "split"}
    assert at_load == {(m.out_features, m.in_features) for m in split if m.out_features % threads == 0}
    calls.clear()
    x = torch.randn(rows, 96) * 4
    with torch.inference_mode():
        assert torch.equal(split(x), plain(x))
        assert torch.equal(split(x[None] * 3), plain(x[None] * 3))  # [1, rows, in] the same
    verdicts = {(k[0], k[1]): v.identical for k, v in checks.linear.items() if k[3] == rows and k[5] == "split"}
    assert set(verdicts) == {(m.out_features, m.in_features) for m in split if m.out_features % threads == 0}
    runs = sum(verdicts.values())  # once per identical layer per forward, plus each check's own compute
    at_load_rows = rows in (1, 16, 32)  # checked at load (LOAD_TIME_ROWS), before `calls.clear()`
    assert calls.count(rows) == 2 * runs + (0 if at_load_rows else len(verdicts))


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_a_split_gemm_that_differs_from_f_linear_is_refused_and_f_linear_runs(monkeypatch, torch_threads):
    compute = cpu_kernels.PackedLinear.split_compute

    def off_by_one_ulp(self, x2):
        y = compute(self, x2)
        y[-1, -1] = torch.nextafter(y[-1, -1], torch.tensor(float("inf")))
        return y

    monkeypatch.setattr(cpu_kernels.PackedLinear, "split_compute", off_by_one_ulp)
    torch_threads(2)
    checks = FastPathChecks()
    plain, split = _linear_stack(7), _linear_stack(7)
    cpu_kernels.pack_linears(split, checks=checks)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        assert torch.equal(split(x), plain(x))  # the wrong kernel never reaches the output
    report = checks.report()
    for shape in ("96->200", "200->64 +bias"):  # 1, 16 and 32 rows at load, 3 on first use
        assert report["split_linear"]["shapes"][shape] == {"split_rows": [], "refused_rows": [1, 3, 16, 32]}
        # where the split is refused, decode batches of 16+ rows fall back to the packed GEMM's check
        packed = report["packed_linear"]["shapes"][shape]
        assert sorted(packed["packed_rows"] + packed["refused_rows"]) == [16, 32]
    assert any("200->64 at 3 rows" in r and "split differs" in r for r in report["packed_linear"]["refused"])


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_a_packed_gemm_that_differs_from_f_linear_is_refused_and_f_linear_runs(monkeypatch, packed_only):
    # Force the failing verification: a packed GEMM that is off by one ulp in one element.
    compute = cpu_kernels.PackedLinear.compute

    def off_by_one_ulp(self, x2):
        y = compute(self, x2)
        y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(float("inf")))
        return y

    monkeypatch.setattr(cpu_kernels.PackedLinear, "compute", off_by_one_ulp)
    checks = FastPathChecks()
    plain, packed = _linear_stack(4), _linear_stack(4)
    assert cpu_kernels.pack_linears(packed, checks=checks) > 0
    x = torch.randn(40, 96)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))  # the wrong kernel never reaches the output
    assert checks.linear and not any(v.identical for k, v in checks.linear.items() if k[5] == "packed")
    report = checks.report()["packed_linear"]
    for shape in ("96->200", "200->64 +bias"):  # checked at load (16, 32 rows) and on first use (40)
        assert report["shapes"][shape] == {"packed_rows": [], "refused_rows": [16, 32, 40]}
    assert any("200->64 at 40 rows" in r and "F.linear is used" in r for r in report["refused"])


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_a_packed_model_is_freed_as_soon_as_it_is_dropped():
    import weakref

    model = _linear_stack(3)
    assert cpu_kernels.pack_linears(model) > 0
    with torch.inference_mode():
        model(torch.randn(20, 96))
    gone = weakref.ref(model)
    del model  # no reference cycle through the packed forwards: freed now, not at the next GC pass
    assert gone() is None


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_packing_respects_its_memory_budget_and_runs_once():
    model = _linear_stack(1)
    assert cpu_kernels.pack_linears(model, budget_bytes=1000) == 0  # too big for the budget: untouched
    assert not any(isinstance(m.forward, cpu_kernels.PackedLinear) for m in model)
    first = cpu_kernels.pack_linears(model)
    forwards = [m.forward for m in model]
    assert first > 0 and cpu_kernels.pack_linears(model) == first  # a second Engine on the same model
    assert [m.forward for m in model] == forwards
    assert cpu_kernels.pack_linears(_linear_stack(2).double()) == 0  # float64: not packed


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_a_second_load_reuses_the_verdicts_on_disk_and_packs_only_what_runs(tmp_path, monkeypatch, packed_only,
                                                                           kernels_win):
    from workbench.engine.run.verdicts import VerdictStore

    calls = _count_calls(monkeypatch)

    def stack():
        torch.manual_seed(5)
        return torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(3)]).eval()

    first = FastPathChecks(VerdictStore(tmp_path / "verdicts.json"))
    assert cpu_kernels.pack_linears(stack(), checks=first) > 0
    assert len(calls) == 2  # one shape, checked at 16 and 32 rows on its first layer
    assert {s for s in first.report()["packed_linear"]["verdicts"]} == {"checked in this process"}
    second = FastPathChecks(VerdictStore(tmp_path / "verdicts.json"))  # the next process
    model, plain = stack(), stack()
    cpu_kernels.pack_linears(model, checks=second)
    assert len(calls) == 2  # nothing computed: the verdicts came from the file
    assert not any(m.forward.packed is not None for m in model)  # and nothing packed yet
    sources = second.report()["packed_linear"]["verdicts"]
    assert list(sources) == [s for s in sources if s.startswith("cached verdict from 20")]
    assert sum(len(v) for v in sources.values()) == 2
    x = torch.randn(16, 96)
    with torch.inference_mode():
        one = torch.randn(1, 96)
        assert torch.equal(model(one), plain(one))  # 1 row: F.linear, never packed
        assert torch.equal(model(x), plain(x))  # first call at 16 rows: F.linear, nothing packed
        assert not any(m.forward.packed is not None for m in model) and len(calls) == 2
        assert torch.equal(model(x), plain(x))  # second: packed (where identical), bit for bit the same
    identical = second.linear[(96, 96, True, 16, torch.get_num_threads(), "packed")].identical
    assert all((m.forward.packed is not None) == identical for m in model)
    (tmp_path / "verdicts.json").write_text("{not json")  # a damaged file: ignored, checked again
    third = FastPathChecks(VerdictStore(tmp_path / "verdicts.json"))
    cpu_kernels.pack_linears(stack(), checks=third)
    assert len(calls) == 4 + 3 * identical


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_an_identical_kernel_that_is_slower_than_f_linear_does_not_run(monkeypatch, torch_threads):
    # Identity makes a kernel safe, not fast (on an Intel Xeon the split GEMM loses to F.linear at
    # 1-8 rows): here F.linear wins at every row count, so neither kernel runs and nothing stays packed.
    timed = _fixed_race(monkeypatch, {fastpath.SPLIT: 2.0, fastpath.PACKED: 3.0, fastpath.LINEAR: 1.0})
    split_calls, packed_calls = _count_calls(monkeypatch, "split_compute"), _count_calls(monkeypatch)
    torch_threads(2)
    checks = FastPathChecks()
    plain, model = _linear_stack(8), _linear_stack(8)
    cpu_kernels.pack_linears(model, checks=checks)
    assert timed  # the load-time row counts were raced
    split_calls.clear(), packed_calls.clear()
    with torch.inference_mode():
        for rows in (1, 16, 32):
            x = torch.randn(rows, 96)
            assert torch.equal(model(x), plain(x)) and torch.equal(model(x), plain(x))
    assert split_calls == [] and packed_calls == []  # F.linear computed every one of them
    assert all(m.forward.packed is None for m in model)  # packed for the check only, then let go
    report = checks.report()
    assert report["split_linear"]["shapes"]["96->200"]["split_rows"] == [1, 16, 32]  # identical: it was not that
    routes = report["linear_routes"]["shapes"]["96->200"]
    assert {r: v["ran"] for r, v in routes.items()} == {"1": "F.linear", "16": "F.linear", "32": "F.linear"}
    assert routes["16"]["ms"] == {"split": 2.0, "packed": 3.0, "F.linear": 1.0}


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_the_race_runs_the_fastest_it_timed_and_a_second_load_reuses_it(tmp_path, monkeypatch, torch_threads):
    # The real race on this CPU: whichever entrant won is the one with the best time, it is what
    # computes those rows, and the next process takes the verdict from the file without timing.
    from workbench.engine.run.verdicts import VerdictStore

    split_calls, packed_calls = _count_calls(monkeypatch, "split_compute"), _count_calls(monkeypatch)
    torch_threads(2)
    checks = FastPathChecks(VerdictStore(tmp_path / "verdicts.json"))
    plain, model = _linear_stack(9), _linear_stack(9)
    cpu_kernels.pack_linears(model, checks=checks)
    routes = checks.report()["linear_routes"]["shapes"]
    assert set(routes) == {"96->200", "200->64 +bias"} and all(set(r) == {"1", "16", "32"} for r in routes.values())
    for rows in routes.values():
        for v in rows.values():
            assert v["ms"][v["ran"]] == min(v["ms"].values()) and "F.linear" in v["ms"]
    split_calls.clear(), packed_calls.clear()
    ready = [m.forward.packed is not None for m in model]  # a packed winner stays packed from its check
    with torch.inference_mode():
        x = torch.randn(32, 96)
        for _ in range(2):  # else the packed GEMM runs from its layer's second call
            assert torch.equal(model(x), plain(x))
    ran = {f"{m.in_features}->{m.out_features}{' +bias' if m.bias is not None else ''}": m.forward.route(32)
           for m in model}
    assert split_calls.count(32) == 2 * sum(k == "split" for k in ran.values())
    assert packed_calls.count(32) == sum((1 + r) * (k == "packed") for k, r in zip(ran.values(), ready, strict=True))
    assert {n: k or "F.linear" for n, k in ran.items()} == {n: r["32"]["ran"] for n, r in routes.items()}
    timed = _fixed_race(monkeypatch, {})  # any timing now would fail: ms has no entrant
    second = FastPathChecks(VerdictStore(tmp_path / "verdicts.json"))
    cpu_kernels.pack_linears(_linear_stack(9), checks=second)
    assert timed == []
    again = second.report()["linear_routes"]["shapes"]
    assert {n: {r: v["ran"] for r, v in rows.items()} for n, rows in again.items()} == \
        {n: {r: v["ran"] for r, v in rows.items()} for n, rows in routes.items()}
    assert all(v["source"].startswith("cached verdict from 20") for rows in again.values() for v in rows.values())


def test_the_verdict_file_is_keyed_by_what_the_verdicts_depend_on(monkeypatch):
    from workbench.engine.run import verdicts

    here = verdicts.default_path()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert verdicts.default_path() != here and verdicts.environment()["torch"].endswith("+other")
    monkeypatch.setenv("WORKBENCH_FASTPATH_CACHE", "0")
    assert verdicts.default_store() is None


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason=NO_MKL)
def test_the_engine_reports_which_kernels_ran_and_why(tiny):
    with Engine(tiny, trace_level="off") as engine:
        engine.generate(["a b c"] * 20, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        report = engine.runner.kernel_report()
    assert report["decode_attention"] is cpu_kernels.available()
    assert report["packed_linear_bytes"] == engine.config.cpu_kernels.packed_linear_bytes > 0
    packed = report["checks"]["packed_linear"]["shapes"]
    split = report["checks"]["split_linear"]["shapes"]
    # this model's shapes (the report is the process's: other tests' models are in it too)
    mine = {f"{m.in_features}->{m.out_features}{' +bias' if m.bias is not None else ''}"
            for m in tiny.model.modules() if isinstance(m, torch.nn.Linear)}
    assert f"{tiny.model.config.hidden_size}->{tiny.model.config.vocab_size}" in mine  # lm_head too
    for name in mine:  # 1, 16 and 32 rows at load, 20 (the decode batch) on first use: split, else packed
        decided = set(sum(split.get(name, {}).values(), []))
        refused = set(split.get(name, {}).get("refused_rows", []))
        decided |= set(sum(packed.get(name, {}).values(), []))
        assert decided >= ({1, 16, 20, 32} if torch.get_num_threads() > 1 else {16, 20, 32}), name
        assert set(sum(packed.get(name, {}).values(), [])) >= refused & {16, 20, 32}, name
