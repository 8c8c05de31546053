"""The GEMM replacements of `F.linear` on CPU float32, their checks and the race between them.

Owns: `PackedLinear` (one `nn.Linear`'s forward through MKL's packed weight, `compute`, or as one
GEMM per thread over a slice of the weight's output rows, `split_compute`), `pack_linears` (routing
a model's linears through it), and the three checked replacements of registry.py: `linear.packed`
and `linear.split` (each bit-identical to `F.linear` for one weight shape, row count and thread
count, checked on a seeded probe input: MKL picks its kernel by all three, so nothing is inferred
from one row count to another) and `linear.route` (of the kernels found identical and `F.linear`
itself, the fastest in a timed race on this CPU runs; every entrant computes the same bits); the
C kernels' summation orders, searched per layer until one gives F.linear's bits: the one-row
kernel's (`linear.rowdot`, `RowdotGroup` for a layer's projections in one call) and the blocked
kernel's at 2-64 rows (`linear.blocked`, with the split orders where MKL splits a batch's rows).
`verify_model` decides the common decode batch sizes at load; the rest are decided on first use.
Does not own: loading MKL (native.py), keeping verdicts (book.py) or the C kernels (c/linear_*.c).
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workbench.engine.kernels import native
from workbench.engine.kernels.book import BOOK, Book
from workbench.engine.kernels.native import lock, mkl
from workbench.engine.kernels.verdict import Verdict
from workbench.models.loader import available_bytes

PACKED, SPLIT, ROWDOT, BLOCKED = "packed", "split", "rowdot", "blocked"  # the replacements of F.linear
LINEAR = "F.linear"  # the op they replace, which the race also enters
# where each may run (PackedLinear.route): split at 1-64 rows, packed at 16-256
PACKED_MIN_ROWS, PACKED_MAX_ROWS, SPLIT_MAX_ROWS = 16, 256, 64
LOAD_TIME_ROWS = (1, 16, 32)  # decode batch sizes checked before the first request (the rest on first use)
RACE_REPEATS = 3  # timed rounds per entrant (after one untimed call), the best one counts
# What a decode step sees is each weight read among the model's others: up to RACE_RING_MAX_ROWS rows
# the race sweeps each entrant over a ring of copies of the weight as long as the model's linear
# weights or this many bytes (twice the L3 of these machines), whichever is less, so each call's weight was last read a
# ring ago, as in a step (the packed entrant over packed copies). One call on one weight right
# after an eviction is dominated by its first misses: at one row (192x576: 50-80 us for the C kernel
# and for F.linear alike, against 35 and 49 us a call in the sweep) that made the race pick F.linear
# where it is the slower one in the step; at 32 rows on the AVX2-only EPYC it kept F.linear for
# q/k/v/o/down, 0.37 ms a call in the model's sweep against the blocked kernel's 0.25.
RACE_RING_BYTES = 64 << 20
# Above a decode batch's rows (a prefill's) the GEMM reuses each weight row across many rows and is
# compute-bound: one call per round after this many bytes written. A ring there sweeps 64 MB of
# weights at up to 256 rows: 0.52 s against 0.07 for one 1536x576 shape at 200 rows, paid by every
# new prompt length.
RACE_RING_MAX_ROWS, RACE_EVICT_BYTES = 64, 64 << 20
# A race whose threads spent more than this share of their time waiting for a CPU that other
# processes held (a compiler, a peer engine starting) holds in this process only: a later load does not trust it from disk and
# races again. One such race, on an AVX2-only EPYC while llama.cpp compiled, kept F.linear for
# 576x576 at one row (0.111 against rowdot's 0.128 ms; quiet, rowdot takes 0.066 against 0.099) and
# so kept every later process off the one-C-call decode step.
RACE_BUSY_SHARE = 0.25
NAMES = {PACKED: "linear.packed", SPLIT: "linear.split", ROWDOT: "linear.rowdot", BLOCKED: "linear.blocked"}
# The summation orders the one-row kernel can take (c/linear_rowdot.c), as (P, L, fma): the first P
# products one by one (P = -1: up to the weight row's next 16-byte boundary, 4 on an aligned row),
# then L lanes folded by halves, the leftover products one by one; products rounded before the sum
# unless fma. Tried in this order until one gives F.linear's bits; the first is MKL's at one row on
# the AMD EPYCs (found by probing its sums with +-2^40 pairs among ones: benchmarks/mkl_order.py).
ROWDOT_ORDERS = ((-1, 4, False),) + tuple((p, lanes, fma) for fma in (False, True) for lanes in (4, 8, 16)
                                         for p in (-1, 0, 4, 8, 16) if (p, lanes, fma) != (-1, 4, False))
# The blocked kernel's orders (c/linear_rows.c), as (KC, bias first): an fma chain per output in
# blocks of KC products, the blocks added in turn; the first is MKL's at 4-64 rows on the AMD EPYCs.
BLOCKED_ORDERS = ((192, True),) + tuple((kc, bf) for bf in (True, False) for kc in (192, 256, 128, 384, 96, 64)
                                        if (kc, bf) != (192, True))
# Where no order gives every row's bits, the blocked kernel's rows may be split as MKL splits them at
# some row counts (the AVX512 EPYC at 5-7 and 9-11 rows: the rows of its last whole block of 8 or 4
# in a blocked order, the rest each in a one-row order; at 2-3 rows every row in the one-row order):
# (KC, bias first, head, P, L, fma), the first `head` rows (maybe none) blocked in (KC, bias first),
# the rest in the one-row order (P, L, fma) of ROWDOT_ORDERS.
BLOCKED_MIN_ROWS, BLOCKED_MAX_ROWS = 2, 64
ROWDOT_SEARCH_ROWS = 64  # the order is searched on this many of the weight's rows, then checked on all


def split_order(order: tuple, rows: int) -> tuple:
    """A blocked order as the split kernel takes it, `(KC, bias first, head, P, L, fma)`: a plain
    `(KC, bias first)` is every one of `rows` rows blocked."""
    return tuple(order) if len(order) == 6 else (*order, rows, 0, 4, False)


def blocked_order_known(order: tuple) -> bool:
    """Is `order` (a verdict's facts, perhaps from disk) one the blocked kernel takes: one of
    BLOCKED_ORDERS, or a split of one with a one-row order of ROWDOT_ORDERS after `head` rows?"""
    if len(order) == 2:
        return order in BLOCKED_ORDERS
    return len(order) == 6 and tuple(order[:2]) in BLOCKED_ORDERS and isinstance(order[2], int) and order[2] >= 0 \
        and (order[3], order[4], bool(order[5])) in ROWDOT_ORDERS


_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151


def _probe(rows: int, in_features: int) -> torch.Tensor:
    """The checks' seeded input: activations of both signs and a spread of magnitudes, like a hidden state."""
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen).mul(8)


def _key(packed: PackedLinear, rows: int) -> tuple:
    return (packed.out_features, packed.in_features, packed.module.bias is not None, rows, torch.get_num_threads())


def linear_ok(book: Book, packed: PackedLinear, rows: int, kind: str = PACKED) -> bool:
    """May `packed` compute `rows` rows through its packed weight (`kind` PACKED) or its split GEMM
    (SPLIT)? Decided on first ask (book.py)."""
    return book.decide(NAMES[kind], _key(packed, rows), lambda: _check_linear(packed, rows, kind)).ok


def _check_linear(packed: PackedLinear, rows: int, kind: str) -> Verdict:
    if kind == ROWDOT:
        return _check_rowdot(packed)
    if kind == BLOCKED:
        return _check_blocked(packed, rows)
    module = packed.module
    x = _probe(rows, packed.in_features)
    with torch.inference_mode():
        want = F.linear(x, module.weight, module.bias)
        got = packed.compute(x) if kind == PACKED else packed.split_compute(x)
    if torch.equal(got, want):
        return Verdict(True, f"{kind} GEMM bit-identical to F.linear", {"max_abs_diff": 0.0})
    diff = float((got - want).abs().max())
    return Verdict(False, f"{kind} GEMM differs from F.linear by up to {diff:.3g}; F.linear is used",
                   {"max_abs_diff": diff})


def _rowdot_order_words(order: tuple) -> str:
    p, lanes, fma = order
    first = "the products up to each row's 16-byte boundary" if p < 0 else f"{p} products"
    return f"{first} one by one, {lanes} lanes{', fused multiply-add' if fma else ''}"


def _blocked_order_words(order: tuple) -> str:
    kc, bias_first = order[:2]
    words = f"fma chains in blocks of {kc} products{', the bias first' if bias_first else ''}"
    if len(order) == 6:
        words = f"the first {order[2]} rows {words}, each row after them {_rowdot_order_words(order[3:])}"
    return words


def _check_rowdot(packed: PackedLinear) -> Verdict:
    """Find the summation order in which the one-row kernel gives F.linear's bits for this layer."""
    return _find_order(packed, 1, "one-row kernel", ROWDOT_ORDERS, packed.rowdot_compute, _rowdot_order_words)


def _check_blocked(packed: PackedLinear, rows: int) -> Verdict:
    """Find the block size and bias placement in which the blocked kernel gives F.linear's bits for
    this layer at `rows` rows; where none does, a split of the rows as MKL splits them (`_split_orders`)."""
    verdict = _find_order(packed, rows, "blocked kernel", BLOCKED_ORDERS, packed.blocked_compute, _blocked_order_words)
    if verdict.ok or "orders_tried" not in verdict.facts:
        return verdict
    splits = _split_orders(packed, rows)
    return _find_order(packed, rows, "blocked kernel", splits, packed.blocked_compute, _blocked_order_words) \
        if splits else verdict


def _split_orders(packed: PackedLinear, rows: int) -> tuple:
    """The split orders (see BLOCKED_MIN_ROWS) that give F.linear's bits on the weight's first
    outputs at `rows` rows: rows are computed independently, so the rows before a split and the
    rows after it are searched apart (each order list once, not their product), for each split at
    the last whole block of 8 or of 4 rows, or before the first row (every row in the one-row order)."""
    x = _probe(rows, packed.in_features)
    outs = min(ROWDOT_SEARCH_ROWS, packed.out_features)
    found = []
    with torch.inference_mode():
        want = F.linear(x, packed.module.weight, packed.module.bias)[:, :outs]
        for head in sorted({rows // 8 * 8, rows // 4 * 4, 0} - {rows}, reverse=True):
            top = BLOCKED_ORDERS[0] if head == 0 else next(
                (o for o in BLOCKED_ORDERS if _equal(packed.blocked_compute(x[:head], o, outs), want[:head])), None)
            tail = next((o for o in ROWDOT_ORDERS
                         if _equal(packed.rowdot_rows_compute(x[head:], o, outs), want[head:])), None)
            if top is not None and tail is not None:
                found.append((*top, head, *tail))
    return tuple(found)


def _equal(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got, want)


def _find_order(packed: PackedLinear, rows: int, what: str, orders: tuple, compute: Callable,
                words: Callable[[tuple], str]) -> Verdict:
    """Each of `orders` through `compute(x, order, outputs)` on the weight's first outputs (a cheap
    search), then the first that matched there on all of them: bit-identical to F.linear or refused."""
    module = packed.module
    x = _probe(rows, packed.in_features)
    head = min(ROWDOT_SEARCH_ROWS, packed.out_features)
    with torch.inference_mode():
        want = F.linear(x, module.weight, module.bias)
        for order in orders:
            got = compute(x, order, head)
            if got is None or not torch.equal(got, want[:, :head]):
                continue
            got = compute(x, order)
            if torch.equal(got, want):
                return Verdict(True, f"{what} bit-identical to F.linear in the order: {words(order)}",
                               {"order": list(order), "max_abs_diff": 0.0})
            diff = float((got - want).abs().max())
            return Verdict(False, f"{what} matched F.linear's first {head} outputs but differs by up to {diff:.3g} "
                           "over all of them; F.linear is used", {"order": list(order), "max_abs_diff": diff})
    return Verdict(False, f"none of the {what}'s {len(orders)} summation orders gives F.linear's bits on this CPU; "
                   "F.linear is used", {"orders_tried": len(orders)})


def fastest(book: Book, packed: PackedLinear, rows: int, kinds: tuple[str, ...]) -> str:
    """The fastest, for `packed`'s shape at `rows` rows, of `kinds` (kernels found identical to
    F.linear) and LINEAR itself: raced on first ask with the weight out of cache (keyed also by the
    entrants, so a changed verdict races again)."""
    if not kinds:
        return LINEAR
    entrants = (*kinds, LINEAR)
    verdict = book.decide("linear.route", (*_key(packed, rows), "+".join(entrants)),
                          lambda: _race(packed, rows, entrants),
                          valid=lambda v: v.facts.get("winner") in entrants and isinstance(v.facts.get("ms"), dict)
                          and _quiet_race(v))
    return verdict.facts["winner"]


def _race(packed: PackedLinear, rows: int, entrants: tuple[str, ...]) -> Verdict:
    module = packed.module
    x = _probe(rows, packed.in_features)
    weight, bias = module.weight.detach(), module.bias
    run = {SPLIT: packed.split_compute, PACKED: packed.compute, ROWDOT: packed.rowdot_compute,
           BLOCKED: packed.blocked_compute, LINEAR: lambda x, weight=weight: F.linear(x, weight, bias)}
    best = dict.fromkeys(entrants, float("inf"))
    start = _cpu_mark()
    with torch.inference_mode():
        for kind in entrants:  # not counted: first-call costs (the packing itself) are not the kernel's speed
            _time(kind, run[kind], x)
        if rows <= RACE_RING_MAX_ROWS:  # a sweep over a ring of copies, as a decode step streams the weights
            ring_bytes = min(RACE_RING_BYTES, packed.model_bytes or RACE_RING_BYTES)
            ring = [weight, *(weight.clone() for _ in range(-(-ring_bytes // _nbytes(weight)) - 1))]
            packs = [packed._pack(), *map(packed.pack, ring[1:])] if PACKED in entrants else []
            sweeps = {kind: lambda x, fn=run[kind], ring=ring: [fn(x, weight=w) for w in ring] for kind in entrants}
            if packs:
                sweeps[PACKED] = lambda x, packs=packs: [packed.compute(x, packed=p) for p in packs]
            for _ in range(RACE_REPEATS):
                for kind in entrants:
                    best[kind] = min(best[kind], _time(kind, sweeps[kind], x) / len(ring))
            del ring, packs, sweeps
        else:  # a prefill's rows: compute-bound, one call after the weight left the caches
            evict = torch.empty(RACE_EVICT_BYTES // 4)
            for _ in range(RACE_REPEATS):
                for kind in entrants:
                    evict.fill_(1.0)
                    best[kind] = min(best[kind], _time(kind, run[kind], x))
    winner = min(entrants, key=best.__getitem__)
    ms = {k: round(t * 1e3, 4) for k, t in best.items()}
    waited = _waited_share(start)
    facts = {"winner": winner, "ms": ms, **({"waited": round(waited, 3)} if waited is not None else {})}
    return Verdict(winner != LINEAR, f"{winner} ran fastest", facts)


def _cpu_mark() -> tuple[float, float] | None:
    """(wall, the seconds this process's threads have spent runnable but waiting for a CPU) now, from
    /proc/self/task/*/schedstat (nanoseconds); None where it cannot be read."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    waited = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                waited += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return time.perf_counter(), waited / 1e9


def _waited_share(start: tuple[float, float] | None) -> float | None:
    """The share of the race's threads' time since `start` (`_cpu_mark()`) that they waited for a CPU
    other processes held."""
    end = _cpu_mark()
    if start is None or end is None:
        return None
    wall = (end[0] - start[0]) * max(1, torch.get_num_threads())
    return max(0.0, end[1] - start[1]) / wall if wall > 0 else None


def _quiet_race(verdict: Verdict) -> bool:
    """Whether a race kept on disk was timed on a quiet machine (else it is run again)."""
    waited = verdict.facts.get("waited", 0.0)
    return isinstance(waited, (int, float)) and waited <= RACE_BUSY_SHARE


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _time(kind: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Seconds one call of `fn` (the entrant `kind`) takes."""
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def verify_model(layers: list[PackedLinear], rows: tuple[int, ...] = LOAD_TIME_ROWS) -> float:
    """Decide each distinct layer shape's kernel at the decode batch sizes `rows` now (load time):
    `layer.route(rows)` runs whichever checks its choice needs. Returns the seconds it took."""
    start = time.perf_counter()
    seen: set[tuple[int, int, bool]] = set()
    for p in layers:
        shape = (p.out_features, p.in_features, p.module.bias is not None)
        if shape in seen:
            continue
        seen.add(shape)
        for r in rows:
            p.route(r)
    return time.perf_counter() - start


class PackedLinear:
    """The forward of one `nn.Linear` through its MKL-packed weight (CPU float32, `PACKED_MIN_ROWS` to
    `PACKED_MAX_ROWS` rows) or its split GEMM (1 to `SPLIT_MAX_ROWS` rows), each only at row counts
    where its check found it bit-identical to `F.linear` and the race found it fastest.

    At one row the C dot product (`rowdot_compute`) enters too, and at 4-64 rows the blocked C
    kernel (`blocked_compute`), each in the summation order its check found to give F.linear's bits
    for this layer on this CPU.

    The weight is packed when first needed, not at load: on the layer's second call in that row
    range (the first one, and every call before, computes `F.linear`, which the check found
    bit-identical), or when the check itself needs it: packing every layer of a model writes its
    weights again (MKL's packed layout is padded), which a one-line generation never needs."""

    def __init__(self, lib: ctypes.CDLL, module: torch.nn.Linear, book: Book = BOOK) -> None:
        weight = module.weight.detach()
        self.out_features, self.in_features = weight.shape
        # a weak reference: the module holds this object as its forward, and a cycle would keep the
        # model (and the packed copy) alive after its Engine is dropped, until the cyclic GC runs
        self.lib, self._module, self.book = lib, weakref.ref(module), book
        self.nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.out_features, self.in_features)
        self.packed: torch.Tensor | None = None  # packed by `_pack` when first needed
        self.calls_in_range = 0
        self.model_bytes = 0  # the linear weights of the model this layer is in (pack_linears), 0: unknown
        self._split: tuple[int, int, torch.Tensor] | None = None  # (parts, weight pointer, weight view)
        self.rowdot_order: tuple[int, int, bool] | None = None  # the checked order (linear_ok ROWDOT sets it)
        self.blocked_orders: dict[int, tuple] = {}  # rows -> the blocked kernel's checked order (or split order)
        # (rows, threads) -> route(rows): the per-call memo of this layer's verdicts (the book holds them)
        self._routes: dict[tuple[int, int], str | None] = {}

    def _pack(self) -> torch.Tensor:
        with lock:
            if self.packed is None:
                self.packed = self.pack(self._module().weight.detach())
            return self.packed

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """MKL's packed copy of `weight` (this layer's shape), for `compute(packed=)`."""
        packed = torch.empty(self.nbytes, dtype=torch.uint8)
        self.lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.out_features, self.in_features,
                                  1.0, weight.data_ptr(), self.in_features, packed.data_ptr())
        return packed

    @property
    def module(self) -> torch.nn.Linear:
        return self._module()

    def compute(self, x2: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
        """`x2 [rows, in] -> [rows, out]` through the packed weight, unchecked (`linear_ok` checks it);
        `packed`: another packed weight of the same shape instead (the race's copies)."""
        rows = x2.shape[0]
        x2 = x2.contiguous()
        if packed is None:
            packed = self.packed if self.packed is not None else self._pack()
        bias = self._module().bias
        # with a bias, C starts as the bias and the GEMM adds into it (beta = 1), as F.linear's addmm does
        y = torch.empty((rows, self.out_features), dtype=torch.float32) if bias is None else \
            bias.detach().expand(rows, self.out_features).contiguous()
        self.lib.cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, self.out_features, self.in_features,
                                     x2.data_ptr(), self.in_features, packed.data_ptr(), self.in_features,
                                     0.0 if bias is None else 1.0, y.data_ptr(), self.out_features)
        return y

    def can_split(self) -> bool:
        """Can the split GEMM run with this process's thread count (a slice per thread)?"""
        parts = torch.get_num_threads()
        return parts > 1 and self.out_features % parts == 0

    def split_compute(self, x2: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`x2 [rows, in] -> [rows, out]` as one GEMM per thread, each over a slice of the weight's
        output rows (`torch.bmm` runs the slices in parallel), unchecked (`linear_ok` checks it).
        The weight is not copied: the slices are a view of it. `weight`: another of the same shape
        (the race's copies) instead of the layer's."""
        parts, module = torch.get_num_threads(), self._module()
        rows, n = x2.shape[0], self.out_features
        if weight is not None:
            sliced = weight.view(parts, n // parts, self.in_features).transpose(1, 2)
        else:
            weight = module.weight.detach()
            if self._split is None or self._split[:2] != (parts, weight.data_ptr()):  # a new thread count or weight
                self._split = (parts, weight.data_ptr(), weight.view(parts, n // parts, self.in_features).transpose(1, 2))
            sliced = self._split[2]
        x3 = x2.contiguous().unsqueeze(0).expand(parts, rows, self.in_features)
        bias = module.bias
        y = torch.bmm(x3, sliced) if bias is None else torch.baddbmm(bias.detach().view(parts, 1, n // parts), x3, sliced)
        return y.transpose(0, 1).reshape(rows, n)  # [parts, rows, n/parts] -> [rows, n]

    def rowdot_compute(self, x2: torch.Tensor, order: tuple[int, int, bool] | None = None,
                       out_rows: int | None = None, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """`x2 [1, in] -> [1, out]` through the one-row C kernel in summation `order` (default: the
        checked one), over the weight's first `out_rows` rows (default all), unchecked (`linear_ok`
        checks it); `weight`: another of the same shape instead of the layer's (the race's copies).
        None where the C kernels are unavailable."""
        lib, module = native.load(), self._module()
        order = order or self.rowdot_order
        if lib is None or order is None:
            return None
        n = self.out_features if out_rows is None else out_rows
        x2 = x2.contiguous()
        weight, bias = module.weight.detach() if weight is None else weight, module.bias
        y = torch.empty((1, n), dtype=torch.float32)
        p, lanes, fma = order
        rc = lib.wb_linear_rowdot(weight.data_ptr(), x2.data_ptr(), None if bias is None else bias.data_ptr(),
                                  y.data_ptr(), n, self.in_features, p, lanes, int(fma), torch.get_num_threads())
        return None if rc else y

    def blocked_compute(self, x2: torch.Tensor, order: tuple[int, bool] | None = None,
                        out_cols: int | None = None, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """`x2 [rows, in] -> [rows, out]` through the blocked C kernel in `order` (default: the one
        checked for this many rows), over the weight's first `out_cols` outputs (default all),
        unchecked (`linear_ok` checks it); `weight`: another of the same shape instead of the
        layer's. None where the C kernels are unavailable."""
        lib, module = native.load(), self._module()
        rows = x2.shape[0]
        order = order or self.blocked_orders.get(rows)
        if lib is None or order is None:
            return None
        n = self.out_features if out_cols is None else out_cols
        x2 = x2.contiguous()
        weight, bias = module.weight.detach() if weight is None else weight, module.bias
        y = torch.empty((rows, n), dtype=torch.float32)
        kc, bias_first, head, p, lanes, fma = split_order(order, rows)
        rc = lib.wb_linear_rows_split(x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                      y.data_ptr(), rows, n, self.in_features, kc, int(bias_first), head, p, lanes,
                                      int(fma), torch.get_num_threads())
        return None if rc else y

    def rowdot_rows_compute(self, x2: torch.Tensor, order: tuple[int, int, bool], out_rows: int | None = None
                            ) -> torch.Tensor | None:
        """`x2 [rows, in] -> [rows, out]`, each row as the one-row kernel computes it in `order`,
        over the weight's first `out_rows` rows (default all), unchecked; None where the C kernels
        are unavailable."""
        lib, module = native.load(), self._module()
        if lib is None:
            return None
        n = self.out_features if out_rows is None else out_rows
        x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], n), dtype=torch.float32)
        p, lanes, fma = order
        rc = lib.wb_linear_rowdot_rows(module.weight.detach().data_ptr(), x2.data_ptr(),
                                       None if module.bias is None else module.bias.data_ptr(), y.data_ptr(),
                                       x2.shape[0], n, self.in_features, p, lanes, int(fma), torch.get_num_threads())
        return None if rc else y

    def _blocked_ok(self, rows: int) -> bool:
        if native.load() is None:
            return False
        verdict = self.book.decide(NAMES[BLOCKED], _key(self, rows), lambda: _check_blocked(self, rows),
                                   valid=lambda v: not v.ok or blocked_order_known(tuple(v.facts.get("order", ()))))
        if verdict.ok:
            self.blocked_orders[rows] = tuple(verdict.facts["order"])
        return verdict.ok

    def _rowdot_ok(self) -> bool:
        if native.load() is None:
            return False
        verdict = self.book.decide(NAMES[ROWDOT], _key(self, 1), lambda: _check_rowdot(self),
                                   valid=lambda v: not v.ok or tuple(v.facts.get("order", ())) in ROWDOT_ORDERS)
        if verdict.ok:
            self.rowdot_order = tuple(verdict.facts["order"])
        return verdict.ok

    def route(self, rows: int) -> str | None:
        """Which kernel computes `rows` rows: SPLIT, PACKED or None (`F.linear`). The candidates
        are the split GEMM up to SPLIT_MAX_ROWS and the packed one in its range, each only where
        its check found it identical to `F.linear` on this CPU; of those and `F.linear`, the
        fastest on this CPU runs (the race). Decided on first ask, then kept."""
        key = (rows, torch.get_num_threads())
        kind = self._routes.get(key, ())
        if kind == ():
            kinds = []
            if rows == 1 and self._rowdot_ok():
                kinds.append(ROWDOT)
            if BLOCKED_MIN_ROWS <= rows <= BLOCKED_MAX_ROWS and self._blocked_ok(rows):
                kinds.append(BLOCKED)
            if 1 <= rows <= SPLIT_MAX_ROWS and self.can_split() and linear_ok(self.book, self, rows, SPLIT):
                kinds.append(SPLIT)
            if PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS and linear_ok(self.book, self, rows):
                kinds.append(PACKED)
            won = fastest(self.book, self, rows, tuple(kinds))
            kind = self._routes[key] = None if won == LINEAR else won
            if self.packed is not None and PACKED not in self._routes.values():
                self.packed = None  # packed only for its check or the race: no row count runs it
        return kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self._module()
        rows = x.numel() // self.in_features if x.shape[-1] == self.in_features else 0
        kind = None if (not rows or x.dtype != torch.float32 or x.device.type != "cpu"
                        or torch.is_grad_enabled()) else self.route(rows)
        if kind is None:
            return torch.nn.functional.linear(x, module.weight, module.bias)  # what nn.Linear.forward does
        if kind == ROWDOT:
            return self.rowdot_compute(x.reshape(1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if kind == BLOCKED:
            return self.blocked_compute(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        if kind == SPLIT:
            return self.split_compute(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.packed is None:
            self.calls_in_range += 1
            if self.calls_in_range < 2:  # bit-identical (checked), and packing may never pay off
                return torch.nn.functional.linear(x, module.weight, module.bias)
        return self.compute(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)


def one_row_order(linears: list[torch.nn.Module]) -> tuple[int, int, bool] | str:
    """The summation order in which layers that read the same row run as one call of the one-row
    kernel (each one's route at one row is `linear.rowdot`, in the same order, on the same input
    width), or why they can not."""
    packs = [m.forward for m in linears]
    if not packs:
        return "no layers"
    for p in packs:
        if not isinstance(p, PackedLinear):
            return "is not a packed float32 linear"
        if p.route(1) != ROWDOT:
            return f"runs {NAMES.get(p.route(1), LINEAR)} at one row (its race or its check), not linear.rowdot"
    if any(p.rowdot_order != packs[0].rowdot_order or p.in_features != packs[0].in_features for p in packs):
        return "differ in order or input width"
    return packs[0].rowdot_order


class RowdotGroup:
    """Linear layers that read the same one input row (a layer's q/k/v projections, its gate and up
    projections) through one call of the one-row kernel (`wb_linear_rowdot_group`): each output is
    the dot product `rowdot_compute` gives, so each layer's bits are its own checked ones, and the
    small layers (192 rows) share one parallel region instead of paying one each. Only where every
    member's route at one row is the one-row kernel (its check passed and it won its race) and their
    orders and input widths agree; elsewhere `__call__` returns None and each layer runs its own
    route. A group of one is the leanest call of a single layer at one row.

    Called ~120 times a step at batch 1, so what can be is decided once per set of layers and
    thread count (`_plan`); each call re-checks only what a notebook could have changed since:
    the layers, their forwards, their weight and bias tensors and where those point."""

    def __init__(self) -> None:
        self._plan: tuple | None = None

    def __call__(self, linears: list[torch.nn.Linear], x: torch.Tensor) -> list[torch.Tensor] | None:
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or native.load() is None:
            return None  # (the C kernels may have been switched off since the plan was made)
        threads = torch.get_num_threads()
        plan = self._plan
        if plan is None or plan[0] != linears or plan[1] != threads or not self._current(plan):
            plan = self._plan = self._make(linears, threads)
        if plan[2] is None or x.numel() != plan[3]:
            return None
        _, _, call, in_features, shapes, _ = plan
        x = x.contiguous()
        lead = x.shape[:-1]
        ys = [torch.empty((*lead, n), dtype=torch.float32) for n in shapes]
        rc = call((ctypes.c_void_p * len(ys))(*[y.data_ptr() for y in ys]), x.data_ptr())
        return None if rc else ys

    @staticmethod
    def _current(plan: tuple) -> bool:
        """Are the layers as the plan found them: the same forwards, weight and bias objects, data,
        and (where the group runs) each one's route at one row still the one-row kernel?"""
        key = (1, plan[1])
        for m, forward, weight, bias, ptrs in plan[5]:
            if plan[2] is not None and forward._routes.get(key) != ROWDOT:
                return False
            if m.__dict__.get("forward") is not forward or m._parameters["weight"] is not weight \
                    or m._parameters.get("bias") is not bias \
                    or weight.data_ptr() != ptrs[0] or (bias is not None and bias.data_ptr() != ptrs[1]):
                return False
        return True

    @staticmethod
    def _make(linears: list[torch.nn.Linear], threads: int) -> tuple:
        """(layers, threads, the bound C call or None where the group may not run, input width,
        output widths, what `_current` compares)."""
        seen = []
        for m in linears:
            weight, bias = m._parameters["weight"], m._parameters.get("bias")
            seen.append((m, m.__dict__.get("forward"), weight, bias,
                         (weight.data_ptr() if weight is not None else 0, bias.data_ptr() if bias is not None else 0)))
        packs = [m.forward for m in linears]
        lib = native.load()
        if lib is None or isinstance(one_row_order(linears), str):
            return (list(linears), threads, None, 0, (), seen)
        first, count = packs[0], len(packs)
        w_arr = (ctypes.c_void_p * count)(*[ptrs[0] for *_, ptrs in seen])
        b_arr = (ctypes.c_void_p * count)(*[ptrs[1] or None for *_, ptrs in seen])
        n_arr = (ctypes.c_int64 * count)(*[p.out_features for p in packs])
        peel, lanes, fma = first.rowdot_order
        fn, k = lib.wb_linear_rowdot_group, first.in_features

        def call(y_arr, x_ptr: int, arrays=(w_arr, b_arr, n_arr)) -> int:
            return fn(count, arrays[0], arrays[1], y_arr, arrays[2], x_ptr, k, peel, lanes, int(fma), threads)

        return (list(linears), threads, call, k, tuple(p.out_features for p in packs), seen)


def pack_linears(model: torch.nn.Module, budget_bytes: int | None = None, book: Book = BOOK) -> int:
    """Route every CPU float32 `nn.Linear` of `model` through a PackedLinear (once per model).
    Returns the bytes the packed copies take once all are packed (each is packed when first needed),
    0 when nothing was routed: no MKL, another device or dtype, or more than `budget_bytes` (default:
    a quarter of the memory available now). The common decode batch sizes are decided now."""
    if getattr(model, "_workbench_packed_bytes", None) is not None:
        return model._workbench_packed_bytes
    lib = mkl()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if lib is None or not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32
                                         for m in linears):
        return 0
    need = sum(lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, *m.weight.shape) for m in linears)
    if budget_bytes is None:
        budget_bytes = available_bytes() // 4
    if need > budget_bytes:
        return 0
    weight_bytes = sum(_nbytes(m.weight) for m in linears)
    for m in linears:
        m.forward = PackedLinear(lib, m, book)
        m.forward.model_bytes = weight_bytes
    verify_model([m.forward for m in linears])  # the common decode sizes now
    model._workbench_packed_bytes = need
    return need


