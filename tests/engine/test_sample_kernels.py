"""The sampler's native kernels (engine/kernels/sampling.py): the inverse-CDF draw picks exactly
the tokens its float64-cumsum formula picks, the rank count gives exactly the compare-and-count's
ranks, the top-k gives torch.topk's values and ids in torch's tie order, the argmax torch.argmax's
index, and a kernel that differs is refused and the formula runs."""

from __future__ import annotations

import shutil

import pytest
import torch

from workbench.engine.kernels import Book
from workbench.engine.kernels import sampling as sample_kernels
from workbench.engine.kernels.sampling import draw_formula
from workbench.engine.sample import logprobs
from workbench.engine.sample.sampler import Sampler

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 49152])
@pytest.mark.parametrize("temperature", [0.05, 1.0, 5.0])
def test_the_native_draw_picks_exactly_the_tokens_the_float64_cumsum_formula_picks(vocab, temperature):
    # Seeded sampling is replayable only if the same uniform picks the same token: the kernel must
    # agree with the formula on every row, at the ends of [0, 1) and where top-k / top-p zeroed tails.
    gen = torch.Generator().manual_seed(vocab + int(temperature * 100))
    logits = torch.randn(64, vocab, generator=gen) * 3 / temperature
    logits[:16, max(1, vocab // 4):] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 2.0 ** -60, 0.5, 1.0 - 2.0 ** -53], dtype=torch.float64)
    got = sample_kernels.sample_draw(probs, u)
    assert got is not None  # built, and identical on this CPU's probes
    assert torch.equal(got, draw_formula(probs, u))
    strided = torch.softmax(torch.randn(8, vocab + 5, generator=gen), dim=-1)[:, :vocab]  # rows apart in memory
    assert torch.equal(sample_kernels.sample_draw(strided, u[:8]), draw_formula(strided, u[:8]))


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_rows_with_nan_and_a_refused_draw_kernel_take_the_formula(monkeypatch):
    probs = torch.softmax(torch.randn(6, 300), dim=-1)
    probs[2, 17] = float("nan")
    u = torch.rand(6, dtype=torch.float64)
    ids = sample_kernels.sample_draw(probs, u)
    assert ids[2] == -1 and torch.equal(ids[[0, 1, 3, 4, 5]], draw_formula(probs, u)[[0, 1, 3, 4, 5]])
    # a kernel one token off is refused by its check, and nothing calls it after
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    real = sample_kernels._unchecked_draw
    monkeypatch.setattr(sample_kernels, "_unchecked_draw", lambda p, u: (real(p, u) + 1).clamp(max=p.shape[1] - 1))
    assert sample_kernels.sample_draw(probs, u) is None
    verdict = checks.tables["sample.draw"][()]
    assert not verdict.ok and verdict.facts["mismatches"] > 0
    (reported,) = checks.report()["replacements"]["sample.draw"]["verdicts"]
    assert reported["detail"].startswith("torch: the kernel differed") and not reported["ok"]
    got, _ = Sampler().draw(probs[[0, 1]], _Greedy(2), u[[0, 1]])  # the sampler takes the formula
    assert torch.equal(got, draw_formula(probs[[0, 1]], u[[0, 1]]))


class _Greedy:
    """The one field Sampler.draw reads of a SamplingBatchInfo: which rows are greedy (none)."""

    def __init__(self, rows: int) -> None:
        self.greedy = torch.zeros(rows, dtype=torch.bool)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("vocab", [1, 7, 49152])
def test_token_ranks_by_the_native_count_equal_the_compare_and_count(vocab, monkeypatch):
    # The rank the API reports (1 = the most likely token) for picked, sampled, tied, -inf and NaN
    # picks comes out the same from the kernel as from the torch path it replaces.
    gen = torch.Generator().manual_seed(vocab)
    lp = torch.log_softmax(torch.randn(40, vocab, generator=gen).round(), dim=-1)  # rounded: ties
    chosen = torch.randint(0, vocab, (40,), generator=gen)
    chosen[:8] = lp[:8].argmax(-1)  # greedy rows
    lp[9, 0] = float("nan")
    lp[10] = float("-inf")
    picked = lp.gather(1, chosen[:, None])[:, 0]
    picked[11] = float("nan")
    got = logprobs._ranks(lp, picked)
    assert sample_kernels.count_above(lp, picked) is not None  # the kernel ran
    monkeypatch.setattr(sample_kernels, "count_above", lambda lp, picked: None)
    want = logprobs._ranks(lp, picked)  # the torch path
    assert torch.equal(got, want) and torch.equal(got[:8], torch.ones(8, dtype=torch.int64))


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_the_native_top_k_gives_torch_topks_values_ids_and_tie_order(k, monkeypatch):
    # The traced sampler's records: the same alternatives in the same order as torch.topk, ties
    # included (torch's order among equal values is neither ascending nor descending id).
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(12, 49152, generator=gen) * 2).round()  # long runs of equal values
    x[6:] = torch.softmax(x[6:] * 3, dim=-1)
    x[0, 17] = float("nan")
    vals, ids = sample_kernels.topk(x, k)
    want_v, want_i = x.topk(k, dim=-1)
    assert torch.equal(ids, want_i)
    assert torch.equal(vals.nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert checks.tables["sample.topk"][()].ok  # the kernel, not torch.topk, gave them
    small = torch.randn(2, 100)  # k * 64 > vocabulary: torch's other algorithm, so torch.topk itself
    assert torch.equal(sample_kernels.topk(small, 5)[1], small.topk(5, dim=-1)[1])


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_a_top_k_kernel_with_another_tie_order_is_refused(monkeypatch):
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    real = sample_kernels._unchecked_topk

    def ascending_ids_among_ties(x, k):
        vals, ids = real(x, k)
        keys = vals.double() * 1e6 - ids.double() * 1e-9  # ties by ascending id: not torch's order
        order = keys.argsort(dim=-1, descending=True)
        return vals.gather(1, order), ids.gather(1, order)

    monkeypatch.setattr(sample_kernels, "_unchecked_topk", ascending_ids_among_ties)
    x = torch.randn(4, 49152).round()
    vals, ids = sample_kernels.topk(x, 10)
    assert torch.equal(ids, x.topk(10, dim=-1)[1])  # torch.topk ran: the kernel was refused
    verdict = checks.tables["sample.topk"][()]
    assert not verdict.ok and verdict.facts["mismatches"] > 0


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("vocab", [1, 7, 17, 1000, 49152])
def test_the_greedy_pick_by_the_native_argmax_is_torch_argmaxs(vocab, monkeypatch):
    # Every greedy token: ties for the maximum (the first wins), a NaN anywhere (the first NaN
    # wins, as torch counts NaN the maximum), the tail past the last whole vector, +0 against -0,
    # all -inf, +inf.
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(12, vocab, generator=gen) * 2).round()  # long runs of equal values
    x[1, -1] = float("nan")
    x[2, vocab // 2], x[2, -1] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4] = -x[4].abs() - 1
    x[4, -1], x[4, 0] = 0.0, -0.0
    x[5, -1] = float("inf")
    x[6] = 5.0
    x[7, -1] = x[7].max() + 1  # the maximum in the tail
    got = sample_kernels.argmax(x)
    assert got is not None and checks.tables["sample.argmax"][()].ok  # the kernel ran
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_an_argmax_kernel_that_picks_the_last_tie_is_refused(monkeypatch):
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    real = sample_kernels._unchecked_argmax

    def last_of_ties(x, per_row):
        first = real(x, per_row)
        flipped = real(x.flip(-1).contiguous(), per_row)
        return torch.where(x.isnan().any(-1), first, x.shape[-1] - 1 - flipped)

    monkeypatch.setattr(sample_kernels, "_unchecked_argmax", last_of_ties)
    x = torch.randn(4, 1000).round()
    assert sample_kernels.argmax(x) is None  # refused: first_argmax takes its torch path
    from workbench.engine.sample.argmax import first_argmax
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    verdict = checks.tables["sample.argmax"][()]
    assert not verdict.ok and "differed" in verdict.detail


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (1, 32000), (3, 151936), (32, 49152), (2, 64)])
def test_the_traced_entropy_by_the_native_sum_is_torchs(rows, vocab, threads, monkeypatch):
    # The entropy every traced step records per row: torch's -(p * lp).sum(-1) to the bit, for one
    # row cut between threads (past torch's 32768 grain) and for batches, sharp and flat rows.
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * vocab)
        lp = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 8, dim=-1)
        p = lp.exp()
        got = sample_kernels.entropy(p, lp)
        assert got is not None and checks.tables["sample.entropy"][(threads,)].ok
        assert torch.equal(got, -(p * lp).sum(-1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_an_entropy_kernel_in_another_order_is_refused_and_torch_sums(monkeypatch):
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    monkeypatch.setattr(sample_kernels, "ENTROPY_LANES", (1,))  # one lane: a plain cascade, not torch's vectors
    lp = torch.log_softmax(torch.randn(2, 49152) * 3, dim=-1)
    assert sample_kernels.entropy(lp.exp(), lp) is None
    verdict = checks.tables["sample.entropy"][(torch.get_num_threads(),)]
    assert not verdict.ok and "no listed sum order" in verdict.detail


def _same_as_torchs_ops(x: torch.Tensor, k: int) -> None:
    """sample_kernels.log_softmax(x, out, k) gives torch.log_softmax, torch.argmax, torch.softmax's
    torch.topk and -(p * lp).sum(-1), every bit (NaN entropies where torch's are NaN)."""
    out = torch.empty_like(x)
    got = sample_kernels.log_softmax(x, out, k)
    assert got is not None and sample_kernels.BOOK.tables["sample.log_softmax"][()].ok
    lp = torch.log_softmax(x, dim=-1)
    p = torch.softmax(x, dim=-1)
    values, ids = p.topk(k, dim=-1)
    assert torch.equal(out, lp) and torch.equal(got[0], x.argmax(dim=-1))
    assert torch.equal(got[1][0], values) and torch.equal(got[1][1], ids)
    want = -(p * lp).sum(-1)
    assert torch.equal(got[1][2].isnan(), want.isnan()) and torch.equal(got[1][2][~want.isnan()], want[~want.isnan()])


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, vocab", [(2, 49152), (32, 49152), (3, 151936), (5, 100), (4, 65), (1, 49152),
                                         (1, 151936), (1, 32000), (1, 32769), (1, 1000)])
def test_the_native_log_softmax_is_torchs_to_the_bit_with_its_argmax_and_record(rows, vocab, threads, monkeypatch):
    # The sampler's raw logprobs and greedy pick, and the traced record of each row's distribution,
    # from one native pass per row (one row past torch's 32768 grain cut between the threads):
    # every bit as torch's ops give them, on ties and on masked (-inf) logits.
    monkeypatch.setattr(sample_kernels, "BOOK", Book())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * vocab)
        x = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 10 + 7
        x[0] = (x[0] * 2).round() / 2  # ties for the maximum
        x[-1, : vocab // 5] = float("-inf")
        _same_as_torchs_ops(x, 1 if vocab < 320 else 10)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("threads", [2, 3])
def test_one_row_cut_between_threads_merges_to_torchs_top_k_and_entropy(threads, monkeypatch):
    # One row, its parts on several threads: the maximum tied in every part, a rising row (every
    # value of the later parts enters their top-k: the log of entrants overflows and the part is
    # fed again), a falling one, a flat one (ties everywhere), a sharp one.
    monkeypatch.setattr(sample_kernels, "BOOK", Book())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        vocab = 151936
        rows = [torch.randn(vocab, generator=gen).round() * 3, torch.linspace(-40.0, 12.0, vocab),
                torch.linspace(12.0, -40.0, vocab), torch.full((vocab,), 2.5), torch.randn(vocab, generator=gen) * 40]
        rows[0][[5, vocab // 2, vocab - 3]] = rows[0].max()
        for row in rows:
            for k in (1, 10, 64, 256):
                _same_as_torchs_ops(row[None].clone(), k)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_a_one_row_record_summed_in_another_order_is_refused(monkeypatch):
    # At two threads torch sums one row of 49152 in two chunks; a record summing it in one (the
    # kernel told of one thread) has other entropy bits: its check refuses it and torch's ops run.
    monkeypatch.setattr(sample_kernels, "BOOK", Book())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    real = sample_kernels._unchecked_log_softmax
    monkeypatch.setattr(sample_kernels, "_unchecked_log_softmax", lambda x, out, lanes, k, elanes, threads:
                        real(x, out, lanes, k, elanes, 1 if x.shape[0] == 1 else threads))
    try:
        x = torch.randn(1, 49152) * 3
        assert sample_kernels.log_softmax(x, torch.empty_like(x)) is not None  # the log-softmax itself is the same
        assert sample_kernels.log_softmax(x, torch.empty_like(x), 10) is None
        verdict = sample_kernels.BOOK.tables["sample.model_record"][(2,)]
        assert not verdict.ok and verdict.facts["mismatches"] > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_a_nan_batch_and_the_other_vector_width_go_to_torch(monkeypatch):
    checks = Book()
    monkeypatch.setattr(sample_kernels, "BOOK", checks)
    x = torch.randn(4, 49152) * 3
    x[2, 9] = float("nan")
    assert sample_kernels.log_softmax(x, torch.empty_like(x)) is None  # a NaN row: torch's path
    assert sample_kernels.log_softmax(x[2:3], torch.empty_like(x[2:3]), 10) is None  # and alone
    # the vector width torch does not run here sums in another order: refused, torch's path
    other = 8 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 16
    monkeypatch.setattr(sample_kernels, "BOOK", Book())
    monkeypatch.setattr(sample_kernels, "LOG_SOFTMAX_LANES", (other,))
    assert sample_kernels.log_softmax(torch.randn(4, 49152), torch.empty(4, 49152)) is None
    assert not sample_kernels.BOOK.tables["sample.log_softmax"][()].ok
