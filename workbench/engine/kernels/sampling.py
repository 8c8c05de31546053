"""The sampler's native kernels, each with the torch formula it replaces and the probe that checks it.

Owns: `sample_draw` (the sampler's float64-cumsum inverse-CDF draw, registry.py's `sample.draw`) and
`count_above` (logprobs' compare-and-count of a token's rank, `sample.rank_count`), `argmax`
(the greedy pick, torch.argmax's index, `sample.argmax`), all in c/sample_draw.c; `entropy` (the
traced sampler's `-(p * lp).sum(-1)` in torch's summation order, `sample.entropy`,
c/layer_ops.c); `topk` (the traced sampler's top-k with torch.topk's tie order, `sample.topk`,
c/topk.c); `log_softmax` (the sampler's torch.log_softmax and argmax, and the traced record of
each row's distribution, in one pass per row: `sample.log_softmax` and `sample.model_record`,
c/layer_ops.c); their formulas (`draw_formula`, `count_formula`, torch.topk); and their check: the kernel
and the formula on seeded probe rows (ties, -inf tails, a NaN row, the top end of `u`), the kernel
used only where every row agrees. Does not own: the sampling itself (engine/sample/).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.engine.kernels.book import BOOK
from workbench.engine.kernels.native import load
from workbench.engine.kernels.verdict import Verdict

Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [R, V], per_row [R]) -> [R]


def draw_formula(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's inverse-CDF draw as torch computes it (sampler.Sampler.draw): ids `[R]`."""
    cdf = probs.detach().to(torch.float64).cpu().cumsum(dim=-1)  # [R, V]
    return (cdf <= u.to(torch.float64).cpu()[:, None] * cdf[:, -1:]).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def count_formula(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """How many of each row's values are strictly above `picked` (logprobs._ranks, less one)."""
    return (lp > picked[:, None]).sum(dim=-1)


def _draw_probe(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    u = torch.rand(logits.shape[0], generator=gen, dtype=torch.float64)
    u[-1] = 1.0 - 2.0 ** -53  # the top end, where rounding could step past the last kept token
    return torch.softmax(logits, dim=-1), u


def _count_probe(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities against a picked one of each row: ties, -inf and a NaN row included."""
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp.gather(1, torch.randint(0, lp.shape[1], (lp.shape[0], 1), generator=gen))[:, 0].clone()
    picked[0], lp[1, 0] = float("-inf"), float("nan")
    return lp, picked


def check(kernel: Kernel, formula: Kernel,
          probe: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]) -> Verdict:
    """`kernel` against `formula` on seeded probe rows, `probe(logits, generator)` making their inputs."""
    gen = torch.Generator().manual_seed(11)
    rows = mismatches = 0
    for vocab, temp in ((49152, 1.0), (49152, 0.2), (32000, 3.0), (7, 1.0), (1000, 0.05)):
        logits = torch.randn(16, vocab, generator=gen) * 4 / temp
        logits[:4, vocab // 3:] = float("-inf")  # rows whose tail was cut (top-k / top-p): zeros
        x, per_row = probe(logits, gen)
        got, want = kernel(x, per_row), formula(x, per_row)
        rows += 16
        mismatches += int((got != want).sum())
    facts = {"rows": rows, "mismatches": mismatches}
    if mismatches == 0:
        return Verdict(True, f"kernel: the same result as the torch formula on all {rows} probe rows", facts)
    return Verdict(False, f"torch: the kernel differed from the formula on {mismatches} of {rows} probe rows", facts)


TOPK_KS = (1, 2, 5, 10, 20, 64)  # the k values the top-k check covers (the kernel's algorithm is one for all k)


def _check_topk() -> Verdict:
    """The native top-k against torch.topk, values and ids in order, on tie-heavy probe rows: values
    rounded to a coarse grid (runs of equal values), softmax rows (ties among tiny probabilities),
    NaNs, -inf rows and all-zero rows."""
    gen = torch.Generator().manual_seed(13)
    rows = mismatches = 0
    for vocab, grid in ((49152, 1.0), (49152, 0.0), (32000, 0.25), (151936, 0.01), (4096, 2.0)):
        x = torch.randn(8, vocab, generator=gen) * 3
        if grid:
            x = (x / grid).round() * grid
        x[4:] = torch.softmax(x[4:] * 2, dim=-1)
        x[0, 5], x[1, 100:110], x[2], x[3] = float("nan"), float("nan"), 0.0, float("-inf")
        x[3, 7] = 1.0
        for k in TOPK_KS:
            if k * 64 > vocab:
                continue
            want_v, want_i = x.topk(k, dim=-1)
            got_v, got_i = _unchecked_topk(x, k)
            same = (got_i == want_i) & ((got_v == want_v) | (got_v.isnan() & want_v.isnan()))
            rows += x.shape[0]
            mismatches += int((~same.all(dim=-1)).sum())
    facts = {"rows": rows, "mismatches": mismatches, "k": list(TOPK_KS)}
    if mismatches == 0:
        return Verdict(True, f"kernel: torch.topk's values and ids, in its order, on all {rows} probe rows", facts)
    return Verdict(False, f"torch: the kernel differed from torch.topk on {mismatches} of {rows} probe rows", facts)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` for `x [R, V]` (values and ids, largest first, torch's tie order): by the
    native kernel where it applies (built, CPU float32 rows, k * 64 <= V, found identical on this
    CPU), else torch.topk itself."""
    if (_rows_ok(x) and load() is not None and BOOK.decide("sample.topk", (), _check_topk).ok
            and 1 <= k <= 256 and k * 64 <= x.shape[1]):
        return _unchecked_topk(x, k)
    return x.topk(k, dim=-1)


def _unchecked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals = torch.empty(x.shape[0], k, dtype=torch.float32)
    ids = torch.empty(x.shape[0], k, dtype=torch.int64)
    rc = load().wb_topk(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, vals.data_ptr(), ids.data_ptr(),
                        torch.get_num_threads())
    if rc:
        raise ValueError(f"k must be in [1, 256] with k * 64 <= {x.shape[1]}, got {k}")
    return vals, ids


def _rows_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def count_above(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor | None:
    """Per row of `lp [R, V]` (CPU float32), how many values are strictly above `picked [R]`:
    `count_formula` by the native kernel, without the `[R, V]` mask. None where it does not apply
    (not built, not CPU float32) or was not found identical."""
    if not _rows_ok(lp) or picked.dtype != torch.float32:
        return None
    if load() is None or not BOOK.decide("sample.rank_count", (),
                                         lambda: check(_unchecked_count, count_formula, _count_probe)).ok:
        return None
    return _unchecked_count(lp, picked)


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(dim=-1)` for `x [R, V]` CPU float32 (the first NaN, else the first maximum) by the
    native kernel; None where it does not apply (not built, not CPU float32 rows) or was not found
    identical to torch.argmax on this CPU."""
    if not _rows_ok(x) or load() is None or not BOOK.decide(
            "sample.argmax", (), lambda: check(_unchecked_argmax, argmax_formula, _argmax_probe)).ok:
        return None
    return _unchecked_argmax(x, None)


def argmax_formula(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _unchecked_argmax(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().wb_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _argmax_probe(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with ties for the maximum (values on a coarse grid), NaNs, an all -inf row, +0 and -0
    as the maximum."""
    x = logits.clone()
    x[4:8] = (x[4:8] / 4).round() * 4  # long runs of equal values, the maximum among them
    x[8, 3], x[8, 5] = float("nan"), float("nan")
    x[9] = float("-inf")
    x[10] = -x[10].abs() - 1
    x[10, 5], x[10, 2] = 0.0, -0.0  # -0 first: torch's compare counts them equal, the first wins
    x[11, -1] = float("inf")
    return x, torch.zeros(x.shape[0])


ENTROPY_LANES = (8, 16, 4)  # torch's sum kernel's vector width: its AVX2 build (on AVX512 CPUs too), AVX512
ENTROPY_MIN_VOCAB = 64  # below a vector's width torch reduces several short rows another way


def entropy(p: torch.Tensor, lp: torch.Tensor) -> torch.Tensor | None:
    """`-(p * lp).sum(-1)` for `p, lp [R, V]` CPU float32 (the traced sampler's entropy of each
    row's distribution), by the native kernel in torch's summation order for this thread count;
    None where it does not apply or no listed order matched torch on this CPU."""
    if not (_rows_ok(p) and _rows_ok(lp) and p.shape == lp.shape and p.stride(0) == lp.stride(0)
            and p.shape[1] >= ENTROPY_MIN_VOCAB) or load() is None:
        return None
    threads = torch.get_num_threads()
    verdict = BOOK.decide("sample.entropy", (threads,), lambda: _check_entropy(threads))
    return _unchecked_entropy(p, lp, int(verdict.facts["lanes"]), threads) if verdict.ok else None


def _unchecked_entropy(p: torch.Tensor, lp: torch.Tensor, lanes: int, threads: int) -> torch.Tensor:
    out = torch.empty(p.shape[0], dtype=torch.float32)
    load().wb_entropy(p.data_ptr(), lp.data_ptr(), p.shape[0], p.shape[1], p.stride(0), lanes, threads,
                      out.data_ptr())
    return out


def _check_entropy(threads: int) -> Verdict:
    """Each width of `ENTROPY_LANES` against torch's `-(p * lp).sum(-1)` on seeded distributions:
    one row and batches, vocabularies on both sides of torch's parallel grain (32768), sharp and
    flat distributions, zeros (probabilities that underflowed); the first width matching all."""
    gen = torch.Generator().manual_seed(17)
    probes = []
    for vocab in (49152, 32000, 151936, 50000, 1000, 64):
        for rows, temp in ((1, 1.0), (4, 0.1), (32, 3.0)):
            lp = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 4 / temp, dim=-1)
            probes.append((lp.exp(), lp))
    with torch.inference_mode():
        wants = [-(p * lp).sum(-1) for p, lp in probes]
        for lanes in ENTROPY_LANES:
            if all(torch.equal(_unchecked_entropy(p, lp, lanes, threads), want)
                   for (p, lp), want in zip(probes, wants, strict=True)):
                return Verdict(True, f"kernel: torch's entropy bits on all {len(probes)} probe batches, its sum "
                               f"at {lanes} lanes", {"lanes": lanes, "probes": len(probes)})
    return Verdict(False, f"torch: no listed sum order ({', '.join(map(str, ENTROPY_LANES))} lanes) gives torch's "
                   f"entropy bits at {threads} threads on this CPU", {})


LOG_SOFTMAX_LANES = (16, 8)  # torch's Vectorized<float> width: its AVX512 kernels, its AVX2 ones


Record = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the model's record: values [R, k], ids [R, k], entropy [R]


def log_softmax(logits: torch.Tensor, out: torch.Tensor | None,
                k: int = 0) -> tuple[torch.Tensor, Record | None, torch.Tensor] | None:
    """`torch.log_softmax(logits, dim=-1, out=out)` for `logits [R, V]` (CPU float32 rows), with
    each row's argmax, by one native pass per row (wb_log_softmax, c/layer_ops.c: ATen's own steps,
    SLEEF's exp and log; one row longer than torch's grain is cut between the threads); with `k` the
    traced sampler's record of each row's own distribution too, `p = torch.softmax(logits, -1)` (the
    same exps, kept, times the reciprocal of their sum): `torch.topk(p, k)` and `-(p * lp).sum(-1)`,
    without an `[R, V]` p. `out` None (with `k`; not for one row of at most 32768 at several
    threads): the log-softmax is not stored, only used for the record. Returns `(argmax [R], (values [R, k], ids [R, k], entropy [R]) or None,
    stats [R, 2])`, stats holding each row's maximum and log of its sum, from which `lp_at` gives the
    log-softmax at any index; None where it does not apply (no rows, not CPU float32, a vocabulary
    under 64, k outside the top-k kernel's range, no compiler), was not found identical on this CPU,
    or a row holds a NaN or an infinite maximum: the caller runs torch's ops, and nothing was written
    that it relies on."""
    rows = logits.shape[0] if logits.dim() == 2 else 0
    if rows < 1 or not _rows_ok(logits) or not 64 <= logits.shape[1] < 2**31 \
            or load() is None:
        return None
    if out is None:
        if not k or not _unstored_ok(rows, logits.shape[1], torch.get_num_threads()):
            return None
    elif out.shape != logits.shape or not out.is_contiguous() or out.dtype != torch.float32:
        return None
    verdict = BOOK.decide("sample.log_softmax", (), _check_log_softmax)
    if not verdict.ok:
        return None
    lanes, elanes, threads = int(verdict.facts["lanes"]), 1, torch.get_num_threads()
    if k:
        if not 1 <= k <= 256 or k * 64 > logits.shape[1]:
            return None
        sums = BOOK.decide("sample.entropy", (threads,), lambda: _check_entropy(threads))
        if not sums.ok:
            return None
        elanes = int(sums.facts["lanes"])
        if not BOOK.decide("sample.model_record", (threads,), lambda: _check_record(lanes, elanes, threads)).ok:
            return None
    return _unchecked_log_softmax(logits, out, lanes, k, elanes, threads)


def _unstored_ok(rows: int, vocab: int, threads: int) -> bool:
    """Whether wb_log_softmax can record without storing the log-softmax: not for one row that
    torch sums whole at several threads (its sum is taken after the row's parts, from the stored lp)."""
    return rows > 1 or threads < 2 or min(threads, -(-vocab // 32768)) >= 2


def lp_at(logits: torch.Tensor, stats: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(logits, -1).gather(1, index)` from `log_softmax`'s stats: ATen's
    `(x - max) - log(sum)`, the same two rounded steps, at the `[R, n]` indices only."""
    return (logits.gather(1, index) - stats[:, :1]) - stats[:, 1:]


def _unchecked_log_softmax(logits: torch.Tensor, out: torch.Tensor | None, lanes: int, k: int, elanes: int,
                           threads: int) -> tuple[torch.Tensor, Record | None, torch.Tensor] | None:
    rows, vocab = logits.shape
    argmax = torch.empty(rows, dtype=torch.int64)
    stats = torch.empty(rows, 2, dtype=torch.float32)
    record: Record | None = None
    pointers: tuple[int | None, ...] = (None,) * 4
    if k:
        record = (torch.empty(rows, k, dtype=torch.float32), torch.empty(rows, k, dtype=torch.int64),
                  torch.empty(rows, dtype=torch.float32))
        # the record's p: one row a thread (the row it works on), or one row cut between the threads
        scratch = torch.empty(max(threads, 1), vocab, dtype=torch.float32)
        pointers = (scratch.data_ptr(), *(t.data_ptr() for t in record))
    rc = load().wb_log_softmax(logits.data_ptr(), rows, vocab, logits.stride(0), lanes,
                               out.data_ptr() if out is not None else None, argmax.data_ptr(), k, elanes, *pointers,
                               stats.data_ptr(), threads)
    if rc < 0:
        raise ValueError(f"wb_log_softmax: lanes {lanes}, k {k}, elanes {elanes}, vocabulary {vocab} or an unstored "
                         "log-softmax out of its range")
    if rc:
        return None  # a NaN or an infinite maximum in some row: torch's ops
    return argmax, record, stats


def _log_softmax_probes() -> list[torch.Tensor]:
    """Seeded logits: vocabularies with and without a tail past whole vectors, sharp and flat rows,
    large offsets, ties for the maximum, -inf entries (logits a model masked); each batch of four
    rows, then rows of them alone (one row longer than torch's grain is cut between the threads, ties
    for the maximum falling in both parts) and one rising row (each value a new top-k)."""
    gen = torch.Generator().manual_seed(23)
    batches = []
    for vocab in (49152, 32000, 151936, 50257, 1000, 64, 65, 100):
        for scale in (0.05, 1.0, 6.0, 40.0):
            x = torch.randn(4, vocab, generator=gen) * scale + torch.randn(4, 1, generator=gen) * 30
            x[1] = (x[1] / 4).round() * 4  # runs of equal values, the maximum among them
            x[2, : vocab // 3] = float("-inf")
            batches.append(x)
    alone = [x[r:r + 1] for x in batches if x.shape[1] > 32768 or x.shape[1] == 1000 for r in range(4)]
    return batches + alone + [torch.linspace(-30.0, 10.0, 49152)[None]]


def _check_log_softmax() -> Verdict:
    """The native log-softmax against torch.log_softmax (every bit, stored and as `lp_at` gives it
    from the stats) and its argmax against torch.argmax, at each vector width of LOG_SOFTMAX_LANES,
    on the probes; a batch with a NaN
    must be refused (left to torch), and a row with one in its second part. The first width
    matching all is kept (lanes in facts)."""
    probes = _log_softmax_probes()
    nan, nan_row = probes[0].clone(), probes[0][3:].clone()
    nan[3, 11] = nan_row[0, 40000] = float("nan")
    threads = torch.get_num_threads()
    with torch.inference_mode():
        wants = [(torch.log_softmax(x, dim=-1), x.argmax(dim=-1)) for x in probes]
        for lanes in LOG_SOFTMAX_LANES:
            ok = True
            for x, (want_lp, want_arg) in zip(probes, wants, strict=True):
                out = torch.empty_like(x)
                got = _unchecked_log_softmax(x, out, lanes, 0, 1, threads)
                every = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # lp_at from the stats, at every index
                if got is None or not torch.equal(out, want_lp) or not torch.equal(got[0], want_arg) \
                        or not torch.equal(lp_at(x, got[2], every), want_lp):
                    ok = False
                    break
            if ok and all(_unchecked_log_softmax(x, torch.empty_like(x), lanes, 0, 1, threads) is None
                          for x in (nan, nan_row)):
                return Verdict(True, f"kernel: torch.log_softmax's bits and torch.argmax on all {len(probes)} probe "
                               f"batches at {lanes} lanes; NaN batches left to torch", {"lanes": lanes,
                                                                                      "probes": len(probes)})
    return Verdict(False, f"torch: no listed vector width ({', '.join(map(str, LOG_SOFTMAX_LANES))}) gives "
                   "torch.log_softmax's bits on this CPU", {})


def _check_record(lanes: int, elanes: int, threads: int) -> Verdict:
    """The fused record (softmax of the logits, its top-k, its entropy) against torch's
    `torch.softmax`, `torch.topk` and `-(p * lp).sum(-1)` on the probes at every k of TOPK_KS that
    applies, with the log-softmax stored and, for a batch, not stored."""
    batches = mismatches = 0
    with torch.inference_mode():
        for x in _log_softmax_probes():
            lp = torch.log_softmax(x, dim=-1)
            p = torch.softmax(x, dim=-1)
            want_entropy = -(p * lp).sum(-1)
            for k in TOPK_KS:
                if k * 64 > x.shape[1]:
                    continue
                want_v, want_i = p.topk(k, dim=-1)
                # the log-softmax stored, and (where _unstored_ok allows) only computed for the record
                unstored = _unstored_ok(x.shape[0], x.shape[1], threads)
                for out in (torch.empty_like(x), None) if unstored else (torch.empty_like(x),):
                    got = _unchecked_log_softmax(x, out, lanes, k, elanes, threads)
                    batches += 1
                    if got is None or got[1] is None:
                        mismatches += 1
                        continue
                    got_v, got_i, got_e = got[1]
                    same = torch.equal(got_v, want_v) and torch.equal(got_i, want_i) and \
                        torch.equal(got_e.isnan(), want_entropy.isnan()) and \
                        bool((got_e == want_entropy).logical_or(got_e.isnan()).all())
                    mismatches += not same
    facts = {"batches": batches, "mismatches": mismatches}
    if mismatches == 0:
        return Verdict(True, f"kernel: softmax's top-k and entropy to the bit on all {batches} probe batches", facts)
    return Verdict(False, f"torch: the fused record differed from torch.softmax, torch.topk and the entropy on "
                   f"{mismatches} of {batches} probe batches", facts)


def sample_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """The sampler's inverse-CDF draw (`draw_formula`: float64 cumsum, count of the cdf at or below
    `u * total`) for `probs [R, V]` CPU float32 and `u [R]` float64, by the native kernel: ids `[R]`
    int64, -1 for a row it leaves to the formula (NaN probabilities). None where the kernel does not
    apply: not built, not CPU float32, or not found identical to the formula on this CPU."""
    if not _rows_ok(probs):
        return None
    if load() is None or not BOOK.decide("sample.draw", (), lambda: check(_unchecked_draw, draw_formula, _draw_probe)).ok:
        return None
    return _unchecked_draw(probs, u)


def _per_row(kernel: str, rows: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """Run the native `kernel(rows, R, V, row stride, per_row, out, threads)`: one int64 per row."""
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    getattr(load(), kernel)(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), per_row.data_ptr(),
                            out.data_ptr(), torch.get_num_threads())
    return out


def _unchecked_count(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    return _per_row("wb_count_above", lp, picked.contiguous())


def _unchecked_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _per_row("wb_sample_draw", probs, u.to(torch.float64).contiguous())
