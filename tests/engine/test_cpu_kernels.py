"""The GEMM fast paths (MKL's packed sgemm and the split GEMM for decode batches): each gives
`F.linear`'s bits on whatever CPU runs it or is refused for that shape and row count, the fastest
identical entrant of a timed race runs, verdicts and races are reused from disk, and the engine
reports which kernel ran and why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.kernels import Book, Store, gemm, native
from workbench.engine.sample.sampling_params import SamplingParams


def _linear_stack(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 200, bias=False), torch.nn.Linear(200, 64, bias=True)).eval()


NO_MKL = "PACKED GEMM NOT CHECKED: this torch has no MKL packed sgemm"


def _count_calls(monkeypatch, method: str = "compute") -> list[int]:
    """The row counts of every call to PackedLinear.`method` (compute: packed, split_compute: split,
    rowdot_compute: the one-row kernel in its checked order; its check's tries of other orders and
    the race's calls on copies of the weight are not counted)."""
    calls: list[int] = []
    compute = getattr(gemm.PackedLinear, method)

    def counted(self, x2, *order, **kw):
        if not order and not kw:
            calls.append(x2.shape[0])
        return compute(self, x2, *order, **kw)

    monkeypatch.setattr(gemm.PackedLinear, method, counted)
    return calls


def _one_ulp_off(monkeypatch, method: str, at: tuple[int, int]) -> None:
    """PackedLinear.`method` made wrong by one ulp at output element `at` (its checks must refuse it)."""
    compute = getattr(gemm.PackedLinear, method)

    def off_by_one_ulp(self, x2, *order):
        y = compute(self, x2, *order)
        if y is not None:
            y[at] = torch.nextafter(y[at], torch.tensor(float("inf")))
        return y

    monkeypatch.setattr(gemm.PackedLinear, method, off_by_one_ulp)


@pytest.fixture
def packed_only(monkeypatch):
    """No split GEMM: the packed GEMM alone, as on one thread or where every split is refused."""
    monkeypatch.setattr(gemm, "SPLIT_MAX_ROWS", 0)


def _fixed_race(monkeypatch, ms: dict[str, float]) -> list[str]:
    """The race as if each entrant took `ms[kind]` (nothing is run: which kernel wins on this CPU
    is not what the calling test is about). Returns the entrants timed, in order."""
    timed: list[str] = []

    def fake(kind, fn, x):
        timed.append(kind)
        return ms.get(kind, 9.0) / 1e3  # an entrant not named loses

    monkeypatch.setattr(gemm, "_time", fake)
    return timed


def _by_shape(section: dict, name: str) -> dict[str, dict[str, list[int]]]:
    """Per shape ("96->200", "200->64 +bias"), the row counts the GEMM replacement `name` passed
    ("ok") and was refused at, from the report's one section."""
    out: dict[str, dict[str, list[int]]] = {}
    for v in section["replacements"][name]["verdicts"]:
        k = v["key"]
        shape = f"{k['in_features']}->{k['out_features']}{' +bias' if k['bias'] else ''}"
        out.setdefault(shape, {"ok": [], "refused": []})["ok" if v["ok"] else "refused"].append(k["rows"])
    return out


def _routes(section: dict) -> dict[str, dict[str, dict]]:
    """Per shape and row count, what the race ran, its times and where that verdict came from."""
    out: dict[str, dict[str, dict]] = {}
    for v in section["replacements"]["linear.route"]["verdicts"]:
        k = v["key"]
        shape = f"{k['in_features']}->{k['out_features']}{' +bias' if k['bias'] else ''}"
        out.setdefault(shape, {})[str(k["rows"])] = {"ran": v["facts"]["winner"], "ms": v["facts"]["ms"],
                                                     "source": v["source"]}
    return out


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
    _fixed_race(monkeypatch, {gemm.SPLIT: 1.0, gemm.PACKED: 2.0, gemm.LINEAR: 3.0})


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 100, 200])
def test_packed_linears_give_exactly_what_f_linear_gives(rows, monkeypatch, packed_only, kernels_win):
    # On any CPU: the output is F.linear's bit for bit (greedy parity with transformers relies on
    # it). The packed GEMM runs only at the row counts this CPU's check found identical.
    calls = _count_calls(monkeypatch)
    checks = Book()
    plain, packed = _linear_stack(0), _linear_stack(0)
    assert gemm.pack_linears(packed, book=checks) > 0
    assert all(isinstance(m.forward, gemm.PackedLinear) for m in packed)
    x = torch.randn(2, rows, 96) * 4
    n = 2 * rows
    with torch.inference_mode():
        ready = [m.forward.packed is not None for m in packed]  # packed at load by the check itself
        assert torch.equal(packed(x), plain(x))
        first = calls.count(n)
        assert torch.equal(packed(x * 2), plain(x * 2))
    verdicts = {(k[0], k[1]): v.ok for k, v in checks.tables["linear.packed"].items() if k[3] == n}
    if not gemm.PACKED_MIN_ROWS <= n <= gemm.PACKED_MAX_ROWS:
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


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 40, 64])
def test_split_gemms_for_decode_batches_give_exactly_what_f_linear_gives(rows, threads, monkeypatch, kernels_win,
                                                                          torch_threads):
    # On any CPU: 1-64 rows (decode batches) come out as F.linear's bits, and the split GEMM ran
    # exactly for the shapes this CPU's check found identical (with 3 threads, 64 output rows do
    # not split in three: not split, not checked).
    calls = _count_calls(monkeypatch, "split_compute")
    torch_threads(threads)
    checks = Book()
    plain, split = _linear_stack(6), _linear_stack(6)
    assert gemm.pack_linears(split, book=checks) > 0
    at_load = {(k[0], k[1]) for k in checks.tables["linear.split"]}
    assert at_load == {(m.out_features, m.in_features) for m in split if m.out_features % threads == 0}
    calls.clear()
    x = torch.randn(rows, 96) * 4
    with torch.inference_mode():
        assert torch.equal(split(x), plain(x))
        assert torch.equal(split(x[None] * 3), plain(x[None] * 3))  # [1, rows, in] the same
    verdicts = {(k[0], k[1]): v.ok for k, v in checks.tables["linear.split"].items() if k[3] == rows}
    assert set(verdicts) == {(m.out_features, m.in_features) for m in split if m.out_features % threads == 0}
    runs = sum(verdicts.values())  # once per identical layer per forward, plus each check's own compute
    at_load_rows = rows in (1, 16, 32)  # checked at load (LOAD_TIME_ROWS), before `calls.clear()`
    assert calls.count(rows) == 2 * runs + (0 if at_load_rows else len(verdicts))


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_a_split_gemm_that_differs_from_f_linear_is_refused_and_f_linear_runs(monkeypatch, torch_threads):
    _one_ulp_off(monkeypatch, "split_compute", (-1, -1))
    torch_threads(2)
    checks = Book()
    plain, split = _linear_stack(7), _linear_stack(7)
    gemm.pack_linears(split, book=checks)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        assert torch.equal(split(x), plain(x))  # the wrong kernel never reaches the output
    report = checks.report()
    split, packed = _by_shape(report, "linear.split"), _by_shape(report, "linear.packed")
    for shape in ("96->200", "200->64 +bias"):  # 1, 16 and 32 rows at load, 3 on first use
        assert split[shape] == {"ok": [], "refused": [1, 3, 16, 32]}
        # where the split is refused, decode batches of 16+ rows fall back to the packed GEMM's check
        assert sorted(packed[shape]["ok"] + packed[shape]["refused"]) == [16, 32]
    assert any(v["key"]["in_features"] == 200 and v["key"]["rows"] == 3 and "split GEMM differs" in v["detail"]
               for v in report["replacements"]["linear.split"]["verdicts"])


@pytest.mark.skipif(native.mkl() is None or native.load() is None, reason=NO_MKL + " or no C compiler")
def test_the_one_row_kernel_gives_f_linears_bits_in_the_order_it_found(monkeypatch, torch_threads):
    # Batch-1 decode: each layer's one row comes out as F.linear's bits; the C kernel ran for exactly
    # the layers whose check found a summation order that reproduces MKL's on this CPU, in that order.
    _fixed_race(monkeypatch, {gemm.ROWDOT: 1.0, gemm.SPLIT: 2.0, gemm.LINEAR: 3.0})
    calls = _count_calls(monkeypatch, "rowdot_compute")
    torch_threads(2)
    checks = Book()
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(96, 200, bias=False), torch.nn.Linear(200, 576, bias=True),
                                torch.nn.Linear(576, 1000, bias=False)).eval()
    fast = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
                                 for m in plain]).eval()
    fast.load_state_dict(plain.state_dict())
    with torch.no_grad():  # weights 40 bytes past a 64-byte boundary, as a GGUF-loaded model's are
        for m in (*plain, *fast):
            store = torch.empty(m.weight.numel() + 16)
            m.weight = torch.nn.Parameter(store[10:10 + m.weight.numel()].view_as(m.weight).copy_(m.weight))
    gemm.pack_linears(fast, book=checks)
    verdicts = {k[1]: v for k, v in checks.tables["linear.rowdot"].items()}
    assert sorted(verdicts) == [96, 200, 576] and all(k[3] == 1 for k in checks.tables["linear.rowdot"])
    for v in verdicts.values():
        assert not v.ok or tuple(v.facts["order"]) in gemm.ROWDOT_ORDERS
    calls.clear()
    x = torch.randn(1, 96) * 4
    with torch.inference_mode():
        assert torch.equal(fast(x), plain(x))
        assert torch.equal(fast(x[None] * 3), plain(x[None] * 3))  # [1, 1, in] the same
    assert len(calls) == 2 * sum(v.ok for v in verdicts.values())
    assert [m.forward.route(1) == gemm.ROWDOT for m in fast] == [verdicts[m.in_features].ok for m in fast]


@pytest.mark.skipif(native.mkl() is None or native.load() is None, reason=NO_MKL + " or no C compiler")
def test_layers_reading_one_row_in_one_call_give_each_layers_own_bits(monkeypatch, torch_threads):
    # The direct forward's q/k/v (and gate/up) at batch 1: one call of the group kernel gives each
    # layer exactly F.linear's bits, a bias included; where one layer's own route is not the one-row
    # kernel the group steps aside (None) and each layer runs its own.
    _fixed_race(monkeypatch, {gemm.ROWDOT: 1.0, gemm.SPLIT: 2.0, gemm.LINEAR: 3.0})
    torch_threads(2)
    torch.manual_seed(5)
    layers = [torch.nn.Linear(576, n, bias=b).eval() for n, b in ((576, False), (192, True), (200, False))]
    plain = [torch.nn.Linear(576, m.out_features, bias=m.bias is not None) for m in layers]
    for p, m in zip(plain, layers, strict=True):
        p.load_state_dict(m.state_dict())
    gemm.pack_linears(torch.nn.Sequential(*layers), book=Book())
    group = gemm.RowdotGroup()
    x = torch.randn(1, 1, 576) * 3
    with torch.inference_mode():
        assert all(m.forward.route(1) == gemm.ROWDOT for m in layers)
        got = group(layers, x)
        assert got is not None and [y.shape for y in got] == [(1, 1, 576), (1, 1, 192), (1, 1, 200)]
        for y, p in zip(got, plain, strict=True):
            assert torch.equal(y, p(x))
        with torch.no_grad():  # a weight replaced in place keeps its pointer; a new one is picked up
            layers[1].weight = torch.nn.Parameter(layers[1].weight * 2)
            plain[1].weight = torch.nn.Parameter(plain[1].weight * 2)
        assert torch.equal(group(layers, x)[1], plain[1](x))
        layers[2].forward._routes[(1, torch.get_num_threads())] = None  # this layer's route: F.linear
        assert group(layers, x) is None
        assert group(layers[:2], torch.randn(2, 576)) is None  # two rows: not the one-row kernel's


@pytest.mark.skipif(native.mkl() is None or native.load() is None, reason=NO_MKL + " or no C compiler")
def test_a_one_row_kernel_off_by_one_ulp_is_refused_and_f_linear_runs(monkeypatch, torch_threads):
    _one_ulp_off(monkeypatch, "rowdot_compute", (0, -1))
    _fixed_race(monkeypatch, {gemm.ROWDOT: 1.0, gemm.SPLIT: 2.0, gemm.LINEAR: 3.0})
    torch_threads(2)
    checks = Book()
    plain, fast = _linear_stack(8), _linear_stack(8)
    gemm.pack_linears(fast, book=checks)
    x = torch.randn(1, 96)
    with torch.inference_mode():
        assert torch.equal(fast(x), plain(x))
    report = checks.report()["replacements"]["linear.rowdot"]["verdicts"]
    assert len(report) == 2 and not any(v["ok"] for v in report)
    assert all("F.linear is used" in v["detail"] for v in report)
    assert all(m.forward.route(1) != gemm.ROWDOT for m in fast)


@pytest.mark.skipif(native.mkl() is None or native.load() is None, reason=NO_MKL + " or no C compiler")
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 11, 17, 33, 64])
def test_the_blocked_kernel_gives_f_linears_bits_at_decode_batch_sizes(rows, monkeypatch, torch_threads):
    # Decode batches: the output is F.linear's bits; the blocked kernel ran for exactly the layers
    # whose check found MKL's block order on this CPU at this row count (at 2-3, 5 and 9-11 rows on
    # the AVX512 EPYC, a split one: MKL's last rows, or all of them, in its one-row order).
    _fixed_race(monkeypatch, {gemm.BLOCKED: 1.0, gemm.SPLIT: 2.0, gemm.PACKED: 3.0, gemm.LINEAR: 4.0})
    calls = _count_calls(monkeypatch, "blocked_compute")
    torch_threads(2)
    checks = Book()
    torch.manual_seed(rows)
    plain = torch.nn.Sequential(torch.nn.Linear(576, 200, bias=True), torch.nn.Linear(200, 1536, bias=False),
                                torch.nn.Linear(1536, 576, bias=False)).eval()
    fast = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
                                 for m in plain]).eval()
    fast.load_state_dict(plain.state_dict())
    gemm.pack_linears(fast, book=checks)
    calls.clear()
    x = torch.randn(rows, 576) * 4
    with torch.inference_mode():
        assert torch.equal(fast(x), plain(x))
    verdicts = {k[1]: v for k, v in checks.tables["linear.blocked"].items() if k[3] == rows}
    assert sorted(verdicts) == [200, 576, 1536]
    for v in verdicts.values():
        assert not v.ok or gemm.blocked_order_known(tuple(v.facts["order"]))
    assert len(calls) == sum(v.ok for v in verdicts.values())
    assert [m.forward.route(rows) == gemm.BLOCKED for m in fast] == [verdicts[m.in_features].ok for m in fast]


@pytest.mark.skipif(native.mkl() is None or native.load() is None, reason=NO_MKL + " or no C compiler")
def test_a_blocked_kernel_off_by_one_ulp_is_refused_and_f_linear_runs(monkeypatch, torch_threads):
    _one_ulp_off(monkeypatch, "blocked_compute", (-1, 0))
    _fixed_race(monkeypatch, {gemm.BLOCKED: 1.0, gemm.LINEAR: 3.0})
    torch_threads(2)
    checks = Book()
    plain, fast = _linear_stack(9), _linear_stack(9)
    gemm.pack_linears(fast, book=checks)
    x = torch.randn(8, 96)
    with torch.inference_mode():
        assert torch.equal(fast(x), plain(x))
    report = _by_shape(checks.report(), "linear.blocked")
    for shape in ("96->200", "200->64 +bias"):  # 16 and 32 rows at load, 8 on first use
        assert report[shape] == {"ok": [], "refused": [8, 16, 32]}
    assert all(m.forward.route(8) != gemm.BLOCKED for m in fast)


def test_the_blocked_kernel_built_without_avx512_gives_the_same_bits(tmp_path):
    # What an AVX2-only CPU builds (-mno-avx512f): 8-lane tiles at every row count, where the
    # AVX512 build runs 16 lanes above 8 rows. Each output's fma chain is its own, so the bits must
    # be this build's at every row count and order, with and without a bias, first or last.
    import ctypes
    import subprocess

    lib = native.load()
    if lib is None:
        pytest.fail("the C kernels did not build: this machine's compiler is what the engine uses")
    out = tmp_path / "rows_avx2.so"
    src = [str(Path(native.__file__).parent / "c" / name) for name in ("linear_rows.c", "linear_rowdot.c")]
    build = subprocess.run([native.compiler(), *native.FLAGS, "-mno-avx512f", *src, "-o", str(out), "-lm"],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    avx2 = ctypes.CDLL(str(out))
    avx2.wb_linear_rows.argtypes, avx2.wb_linear_rows.restype = lib.wb_linear_rows.argtypes, ctypes.c_int
    torch.manual_seed(0)
    w, b = torch.randn(250, 400), torch.randn(250)
    for rows in (3, 8, 9, 16, 24, 33, 64):
        x = torch.randn(rows, 400)
        for kc, bias, first in ((192, None, 1), (192, b, 1), (128, b, 0), (400, None, 1)):
            got, want = torch.full((rows, 250), float("nan")), torch.full((rows, 250), float("nan"))
            args = (x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr())
            assert avx2.wb_linear_rows(*args, got.data_ptr(), rows, 250, 400, kc, first, 2) == 0
            assert lib.wb_linear_rows(*args, want.data_ptr(), rows, 250, 400, kc, first, 2) == 0
            assert torch.equal(got, want), (rows, kc, bias is not None, first)
            assert torch.allclose(got, x @ w.T + (0 if bias is None else bias), rtol=1e-4, atol=1e-3)


def test_the_one_row_kernel_sums_every_product_in_any_order_it_takes():
    lib = native.load()
    if lib is None:
        pytest.fail("the C kernels did not build: this machine's compiler is what the engine uses")
    base, x = torch.randn(37 * 10 + 3), torch.randn(10)
    # 37 rows: each thread's run cut into streams of unequal length (the last one short)
    for n, off in ((8, 0), (8, 1), (8, 3), (37, 0), (37, 2)):  # rows at every 16-byte alignment (10 floats
        w, y = base[off:off + n * 10].view(n, 10), torch.full((n,), float("nan"))  # a row: it changes row to row)
        for p, lanes in ((4, 4), (0, 8), (11, 4), (-1, 4), (-1, 16), (2, 16)):
            assert lib.wb_linear_rowdot(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, 10, p, lanes, 0, 2) == 0
            assert torch.allclose(y, w @ x, rtol=1e-5, atol=1e-5), (n, off, p, lanes)
    for p, lanes in ((0, 3), (-2, 4)):  # 3 lanes is not a width the kernel has; -1 is the only negative
        assert lib.wb_linear_rowdot(base.data_ptr(), x.data_ptr(), None, y.data_ptr(), 8, 10, p, lanes, 0, 2) == -1


def test_several_rows_through_the_one_row_order_give_each_row_the_one_row_kernels_bits():
    # What a split order runs past the blocked kernel's rows (MKL's last rows at 5-7 and 9-11 rows on
    # the AVX512 EPYC): every input row's outputs are the one-row kernel's, bit for bit, in every
    # order, however many rows (blocks of up to four a pass) and weight rows (a short last block).
    lib = native.load()
    if lib is None:
        pytest.fail("the C kernels did not build: this machine's compiler is what the engine uses")
    torch.manual_seed(0)
    base, bias = torch.randn(37 * 100 + 3), torch.randn(37)
    for n, off in ((8, 0), (37, 1), (37, 2)):  # rows at different 16-byte alignments, a short last block
        w = base[off:off + n * 100].view(n, 100)
        for t in (1, 3, 4, 5, 9):
            x = torch.randn(t, 100) * 4
            for p, lanes, fma in ((0, 4, 0), (-1, 4, 0), (4, 8, 1), (-1, 16, 0), (0, 16, 1)):
                b = bias[:n] if fma else None
                got = torch.full((t, n), float("nan"))
                assert lib.wb_linear_rowdot_rows(w.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(),
                                                 got.data_ptr(), t, n, 100, p, lanes, fma, 2) == 0
                for r in range(t):
                    want = torch.full((n,), float("nan"))
                    assert lib.wb_linear_rowdot(w.data_ptr(), x[r].data_ptr(), None if b is None else b.data_ptr(),
                                                want.data_ptr(), n, 100, p, lanes, fma, 2) == 0
                    assert torch.equal(got[r], want), (n, off, t, p, lanes, fma, r)
    assert lib.wb_linear_rowdot_rows(base.data_ptr(), x.data_ptr(), None, got.data_ptr(), 0, 8, 100, 0, 4, 0, 2) == -1


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_a_packed_gemm_that_differs_from_f_linear_is_refused_and_f_linear_runs(monkeypatch, packed_only):
    # Force the failing verification: a packed GEMM that is off by one ulp in one element.
    _one_ulp_off(monkeypatch, "compute", (0, 0))
    checks = Book()
    plain, packed = _linear_stack(4), _linear_stack(4)
    assert gemm.pack_linears(packed, book=checks) > 0
    x = torch.randn(40, 96)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))  # the wrong kernel never reaches the output
    assert checks.tables["linear.packed"] and not any(v.ok for v in checks.tables["linear.packed"].values())
    report = checks.report()
    for shape in ("96->200", "200->64 +bias"):  # checked at load (16, 32 rows) and on first use (40)
        assert _by_shape(report, "linear.packed")[shape] == {"ok": [], "refused": [16, 32, 40]}
    assert any(v["key"]["in_features"] == 200 and v["key"]["rows"] == 40 and "F.linear is used" in v["detail"]
               for v in report["replacements"]["linear.packed"]["verdicts"])


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_a_packed_model_is_freed_as_soon_as_it_is_dropped():
    import weakref

    model = _linear_stack(3)
    assert gemm.pack_linears(model) > 0
    with torch.inference_mode():
        model(torch.randn(20, 96))
    gone = weakref.ref(model)
    del model  # no reference cycle through the packed forwards: freed now, not at the next GC pass
    assert gone() is None


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_packing_respects_its_memory_budget_and_runs_once():
    model = _linear_stack(1)
    assert gemm.pack_linears(model, budget_bytes=1000) == 0  # too big for the budget: untouched
    assert not any(isinstance(m.forward, gemm.PackedLinear) for m in model)
    first = gemm.pack_linears(model)
    forwards = [m.forward for m in model]
    assert first > 0 and gemm.pack_linears(model) == first  # a second Engine on the same model
    assert [m.forward for m in model] == forwards
    assert gemm.pack_linears(_linear_stack(2).double()) == 0  # float64: not packed


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_a_second_load_reuses_the_verdicts_on_disk_and_packs_only_what_runs(tmp_path, monkeypatch, packed_only,
                                                                           kernels_win):
    calls = _count_calls(monkeypatch)
    # a quiet machine: a race whose threads waited for a CPU is raced (and packed) again by the next
    # load, by design and tested on its own below; a process beside this one must not decide this test
    monkeypatch.setattr(gemm, "_waited_share", lambda start: 0.0)

    def stack():
        torch.manual_seed(5)
        return torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(3)]).eval()

    first = Book(Store(tmp_path))
    assert gemm.pack_linears(stack(), book=first) > 0
    assert len(calls) == 2  # one shape, checked at 16 and 32 rows on its first layer
    assert {v["source"] for v in first.report()["replacements"]["linear.packed"]["verdicts"]} == \
        {"checked in this process"}
    second = Book(Store(tmp_path))  # the next process
    model, plain = stack(), stack()
    gemm.pack_linears(model, book=second)
    assert len(calls) == 2  # nothing computed: the verdicts came from the file
    assert not any(m.forward.packed is not None for m in model)  # and nothing packed yet
    sources = [v["source"] for v in second.report()["replacements"]["linear.packed"]["verdicts"]]
    assert len(sources) == 2 and all(s.startswith("cached from 20") for s in sources)
    x = torch.randn(16, 96)
    with torch.inference_mode():
        one = torch.randn(1, 96)
        assert torch.equal(model(one), plain(one))  # 1 row: F.linear, never packed
        assert torch.equal(model(x), plain(x))  # first call at 16 rows: F.linear, nothing packed
        assert not any(m.forward.packed is not None for m in model) and len(calls) == 2
        assert torch.equal(model(x), plain(x))  # second: packed (where identical), bit for bit the same
    identical = second.tables["linear.packed"][(96, 96, True, 16, torch.get_num_threads())].ok
    assert all((m.forward.packed is not None) == identical for m in model)
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")  # a damaged file: ignored, checked again
    third = Book(Store(tmp_path))
    gemm.pack_linears(stack(), book=third)
    assert len(calls) == 4 + 3 * identical


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_an_identical_kernel_that_is_slower_than_f_linear_does_not_run(monkeypatch, torch_threads):
    # Identity makes a kernel safe, not fast (on an Intel Xeon the split GEMM loses to F.linear at
    # 1-8 rows): here F.linear wins at every row count, so neither kernel runs and nothing stays packed.
    timed = _fixed_race(monkeypatch, {gemm.SPLIT: 2.0, gemm.PACKED: 3.0, gemm.LINEAR: 1.0})
    split_calls, packed_calls = _count_calls(monkeypatch, "split_compute"), _count_calls(monkeypatch)
    torch_threads(2)
    checks = Book()
    plain, model = _linear_stack(8), _linear_stack(8)
    gemm.pack_linears(model, book=checks)
    assert timed  # the load-time row counts were raced
    split_calls.clear(), packed_calls.clear()
    with torch.inference_mode():
        for rows in (1, 16, 32):
            x = torch.randn(rows, 96)
            assert torch.equal(model(x), plain(x)) and torch.equal(model(x), plain(x))
    assert split_calls == [] and packed_calls == []  # F.linear computed every one of them
    assert all(m.forward.packed is None for m in model)  # packed for the check only, then let go
    report = checks.report()
    assert _by_shape(report, "linear.split")["96->200"]["ok"] == [1, 16, 32]  # identical: it was not that
    routes = _routes(report)["96->200"]
    assert {r: v["ran"] for r, v in routes.items()} == {"1": "F.linear", "16": "F.linear", "32": "F.linear"}
    ms = routes["16"]["ms"]  # a call's time: each sweep's over the ring's length (+ blocked)
    assert {k: ms[k] / ms["F.linear"] for k in ("split", "packed")} == {"split": 2.0, "packed": 3.0}


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_the_race_runs_the_fastest_it_timed_and_a_second_load_reuses_it(tmp_path, monkeypatch, torch_threads):
    # The real race on this CPU: whichever entrant won is the one with the best time, it is what
    # computes those rows, and the next process takes the verdict from the file without timing
    # (a race beside busy processes is raced again: the next test; here the machine counts as quiet).
    monkeypatch.setattr(gemm, "_waited_share", lambda start: 0.0)
    split_calls, packed_calls = _count_calls(monkeypatch, "split_compute"), _count_calls(monkeypatch)
    torch_threads(2)
    checks = Book(Store(tmp_path))
    plain, model = _linear_stack(9), _linear_stack(9)
    gemm.pack_linears(model, book=checks)
    routes = _routes(checks.report())
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
    second = Book(Store(tmp_path))
    gemm.pack_linears(_linear_stack(9), book=second)
    assert timed == []
    again = _routes(second.report())
    assert {n: {r: v["ran"] for r, v in rows.items()} for n, rows in again.items()} == \
        {n: {r: v["ran"] for r, v in rows.items()} for n, rows in routes.items()}
    assert all(v["source"].startswith("cached from 20") for rows in again.values() for v in rows.values())


def test_a_race_timed_beside_busy_processes_is_raced_again_by_the_next_load(tmp_path, monkeypatch, torch_threads):
    # How long the race's threads waited for a CPU is measured, not assumed: busy loops on every
    # core make two threads computing wait
    torch_threads(2)
    a = torch.randn(384, 384)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.2)
        start, until = gemm._cpu_mark(), time.perf_counter() + 0.5
        while time.perf_counter() < until:
            a = torch.tanh(a @ a)
        share = gemm._waited_share(start)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    if start is not None:  # a machine with /proc/self/task/*/schedstat
        assert share > gemm.RACE_BUSY_SHARE
    timed = _fixed_race(monkeypatch, {gemm.SPLIT: 1.0, gemm.PACKED: 2.0, gemm.LINEAR: 3.0})
    monkeypatch.setattr(gemm, "_waited_share", lambda start: 0.6)  # a compiler held the CPUs meanwhile
    gemm.pack_linears(_linear_stack(9), book=Book(Store(tmp_path)))
    first = len(timed)
    monkeypatch.setattr(gemm, "_waited_share", lambda start: 0.0)
    gemm.pack_linears(_linear_stack(9), book=Book(Store(tmp_path)))
    assert first > 0 and len(timed) == 2 * first  # the file's races were not trusted: timed again, quietly
    gemm.pack_linears(_linear_stack(9), book=Book(Store(tmp_path)))
    assert len(timed) == 2 * first  # and those are


@pytest.mark.skipif(native.mkl() is None, reason=NO_MKL)
def test_the_engine_reports_which_kernels_ran_and_why(tiny):
    with Engine(tiny, trace_level="off") as engine:
        engine.generate(["a b c"] * 20, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        report = engine.runner.kernel_report()
    assert report["decode_attention"] is native.available()
    assert report["packed_linear_bytes"] == engine.config.cpu_kernels.packed_linear_bytes > 0
    packed = _by_shape(report["checks"], "linear.packed")
    split = _by_shape(report["checks"], "linear.split")
    blocked = _by_shape(report["checks"], "linear.blocked")
    # this model's shapes (the report is the process's: other tests' models are in it too)
    mine = {f"{m.in_features}->{m.out_features}{' +bias' if m.bias is not None else ''}"
            for m in tiny.model.modules() if isinstance(m, torch.nn.Linear)}
    assert f"{tiny.model.config.hidden_size}->{tiny.model.config.vocab_size}" in mine  # lm_head too
    for name in mine:  # 1, 16 and 32 rows at load, 20 (the decode batch) on first use: split, else packed;
        # or the blocked kernel, where the decode batch's layers ran in the rows' C call (its verdict
        # may come from disk, so the Python path never asked the others at 20 rows)
        decided = set(sum(split.get(name, {}).values(), []))
        refused = set(split.get(name, {}).get("refused", []))
        decided |= set(sum(packed.get(name, {}).values(), [])) | set(blocked.get(name, {}).get("ok", []))
        assert decided >= ({1, 16, 20, 32} if torch.get_num_threads() > 1 else {16, 20, 32}), name
        assert set(sum(packed.get(name, {}).values(), [])) >= refused & {16, 20, 32}, name
