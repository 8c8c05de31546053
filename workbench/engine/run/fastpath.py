"""The fast paths prove themselves on the CPU they run on: every native kernel the engine uses in
place of the model's own op is checked against that op, on this machine, before its result is used.

Owns: the verdicts (cached per process, keyed by what the kernel's dispatch depends on) and the
report the engine config and traces carry (`report()`). Does not own the kernels (cpu_kernels.py).

- **Packed GEMM** (`cblas_sgemm_compute` instead of `F.linear`): bit identity is checked per
  `(out_features, in_features, bias, rows, threads)`, on the first call with that row count, using the
  module's own packed weight and a seeded probe input. MKL chooses its kernel by the shape, the row
  count and the thread count, so nothing is inferred from one row count to another: every row count
  the engine runs (decode batch sizes, prefill chunks, logits rows) is verified the first time it
  occurs, and the packed result is used only for the row counts that came out identical. Where they
  differ, that call and every later one with those rows take `F.linear`. `verify_model()` checks
  the common decode batch sizes at load time so the report says what was decided before the first
  request. The verdict is per shape, not per weight: identity is a property of the order of the
  operations, which MKL fixes by shape (a probe input of random values exposes any other order).
  Verdicts are also kept on disk (verdicts.py), keyed by the CPU, torch's build, MKL and this code,
  so a second load on the same machine reuses them instead of packing and checking again; the
  report says which verdicts were "checked in this process" and which are a "cached verdict from
  <date>".
- **Split GEMM** (decode batches, 1-64 rows: one GEMM per thread over a slice of the weight's
  output rows, run in parallel by `torch.bmm`): below 16 rows MKL runs `F.linear` on one thread
  (the second core idles while the weights stream through one), and up to 64 rows its own
  threading is slower than one slice per thread (measured on SmolLM2's shapes, AMD EPYC: 1 row
  35 -> 22 ms for all GEMMs, 32 rows 80 -> 65 ms against the packed GEMM). Each output element is
  still one dot product over the same inputs; whether MKL sums it in the same order for a slice
  as for the whole weight is what the check decides, per the same key as the packed GEMM's (plus
  the kind). Where the split is refused (or cannot split: one thread, or output rows that do not
  divide), 16-64 rows fall back to the packed GEMM under its own check.
- **The race**: identity makes a kernel safe, not fast. On an Intel Xeon (AVX-512, 2 cores) the
  split GEMM is slower than `F.linear` at 1-8 rows and than the packed GEMM at 32 (SmolLM2's
  GEMMs at 32 rows: 67 ms split, 48 ms packed), the opposite of the AMD EPYC above. So among the
  kernels found identical for a shape and row count, and `F.linear` itself, the one that runs is
  the fastest of a timed race on this CPU (`fastest`: best of `RACE_REPEATS`, interleaved, on the
  check's probe input). Every entrant computes the same bits, so the race can only change speed.
- **Paged decode attention** (kernels/decode_attention.c instead of gather + masked
  `scaled_dot_product_attention`): at one decode row the torch path computes exactly what
  transformers computes (no padding), so the kernel is used there only if it is bit-identical to it
  (on the x86 CPUs tried it is not: its sums run in another order). At several rows the torch path's
  own bits depend on the other rows of the batch (its padding changes sdpa's reduction order), so
  there is no single result to be identical to; the kernel is used when its error against a float64
  reference is within `ATTENTION_ERROR_FACTOR` times sdpa's own error on the same inputs, and the
  report says "bounded", not "identical". `WORKBENCH_CPU_KERNELS=exact` demands identity there too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from workbench.engine.run.verdicts import VerdictStore, default_store

ENV_SWITCH = "WORKBENCH_CPU_KERNELS"  # "0": no native kernels; "exact": bit identity everywhere
ATTENTION_ERROR_FACTOR = 4.0
LOAD_TIME_ROWS = (1, 16, 32)  # decode batch sizes checked before the first request (the rest on first use)
PACKED, SPLIT = "packed", "split"  # the two replacements of F.linear a LinearVerdict can be about
LINEAR = "F.linear"  # the op they replace, which the race (`fastest`) also enters
# where each may run (cpu_kernels.PackedLinear.route): split at 1-64 rows, packed at 16-256
PACKED_MIN_ROWS, PACKED_MAX_ROWS, SPLIT_MAX_ROWS = 16, 256, 64
RACE_REPEATS = 3  # timed calls per entrant (after one untimed), the best one counts


def exact_only() -> bool:
    return os.environ.get(ENV_SWITCH, "1") == "exact"


CHECKED_NOW = "checked in this process"


@dataclass(slots=True)
class LinearVerdict:
    """Packed (or split) GEMM vs `F.linear` for one weight shape at one row count."""

    identical: bool
    max_abs_diff: float
    source: str = CHECKED_NOW  # or "cached verdict from <date>" (verdicts.py)


@dataclass(slots=True)
class RaceVerdict:
    """Which of F.linear and the kernels identical to it ran fastest for one shape at one row count."""

    winner: str  # SPLIT, PACKED or LINEAR
    ms: dict[str, float]  # each entrant's best time
    source: str = CHECKED_NOW


@dataclass(slots=True)
class DrawVerdict:
    """One of the sampler's native kernels (the draw, the rank count) vs its torch formula, on
    seeded probe distributions."""

    identical: bool
    rows: int  # probe rows compared
    mismatches: int


@dataclass(slots=True)
class AttentionVerdict:
    """The decode-attention kernel vs the torch path for one head layout."""

    single_row: bool  # use the kernel when one decode row runs
    multi_row: bool  # use it for several rows
    single_row_max_diff: float  # kernel vs torch at one row (0.0 = identical)
    kernel_error: float  # max |kernel - float64 reference| over the multi-row probes
    torch_error: float  # max |sdpa - float64 reference| over the same probes
    seconds: float


@dataclass(slots=True)
class FastPathChecks:
    """The per-process verdicts, and optionally the on-disk `store` of earlier processes' linear
    verdicts (the process-wide CHECKS has one; a fresh FastPathChecks() checks everything itself)."""

    store: VerdictStore | None = None
    linear: dict[tuple[int, int, bool, int, int, str], LinearVerdict] = field(default_factory=dict)
    races: dict[tuple[int, int, bool, int, int, str], RaceVerdict] = field(default_factory=dict)
    attention: dict[tuple[int, int, int], AttentionVerdict] = field(default_factory=dict)
    sampler_kernels: dict[str, DrawVerdict] = field(default_factory=dict)
    load_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- packed GEMM --------------------------------------------------------------------------

    def linear_ok(self, packed: Any, rows: int, kind: str = PACKED) -> bool:
        """May `packed` (a cpu_kernels.PackedLinear) compute `rows` rows through its packed weight
        (`kind` PACKED) or its split GEMM (SPLIT)? Verified on first ask."""
        module = packed.module
        key = (packed.out_features, packed.in_features, module.bias is not None, rows, torch.get_num_threads(), kind)

        def cached(store: VerdictStore) -> LinearVerdict | None:
            found = store.get(key)
            return None if found is None else LinearVerdict(found[0], found[1], f"cached verdict from {found[2]}")

        return self._kept(self.linear, key, cached, lambda: self._verify_linear(packed, module, rows, kind),
                          lambda store, v: store.put(key, v.identical, v.max_abs_diff)).identical

    def _kept(self, table: dict, key: tuple, cached: Callable[[VerdictStore], Any], decide: Callable[[], Any],
              keep: Callable[[VerdictStore, Any], None]) -> Any:
        """`table[key]`, else what an earlier process left in the verdict file (`cached`), else
        `decide()` now, kept in the file (`keep`) and in `table` for the rest of the process."""
        verdict = table.get(key)
        if verdict is None:
            verdict = cached(self.store) if self.store is not None else None
            if verdict is None:
                verdict = decide()
                if self.store is not None:
                    keep(self.store, verdict)
            with self.lock:
                table[key] = verdict
        return verdict

    @staticmethod
    def _verify_linear(packed: Any, module: torch.nn.Linear, rows: int, kind: str) -> LinearVerdict:
        x = _probe(rows, packed.in_features)
        with torch.inference_mode():
            want = F.linear(x, module.weight, module.bias)
            got = packed.compute(x) if kind == PACKED else packed.split_compute(x)
        if torch.equal(got, want):
            return LinearVerdict(True, 0.0)
        return LinearVerdict(False, float((got - want).abs().max()))

    def fastest(self, packed: Any, rows: int, kinds: tuple[str, ...]) -> str:
        """The fastest, for `packed`'s shape at `rows` rows, of `kinds` (kernels its checks found
        identical to F.linear) and LINEAR itself. Raced on first ask, then kept for the process
        and in the verdict file (keyed also by the entrants, so a changed verdict races again)."""
        if not kinds:
            return LINEAR
        entrants = (*kinds, LINEAR)
        module = packed.module
        key = (packed.out_features, packed.in_features, module.bias is not None, rows, torch.get_num_threads(),
               "+".join(entrants))

        def cached(store: VerdictStore) -> RaceVerdict | None:
            found = store.get_race(key)
            return None if found is None or found[0] not in entrants else \
                RaceVerdict(found[0], found[1], f"cached verdict from {found[2]}")

        return self._kept(self.races, key, cached, lambda: self._race(packed, module, rows, entrants),
                          lambda store, v: store.put_race(key, v.winner, v.ms)).winner

    @classmethod
    def _race(cls, packed: Any, module: torch.nn.Linear, rows: int, entrants: tuple[str, ...]) -> RaceVerdict:
        x = _probe(rows, packed.in_features)
        run = {SPLIT: packed.split_compute, PACKED: packed.compute,
               LINEAR: lambda x: F.linear(x, module.weight, module.bias)}
        best = dict.fromkeys(entrants, float("inf"))
        with torch.inference_mode():
            for kind in entrants:  # not counted: first-call costs (the packing itself) are not the kernel's speed
                cls._time(kind, run[kind], x)
            for _ in range(RACE_REPEATS):
                for kind in entrants:
                    best[kind] = min(best[kind], cls._time(kind, run[kind], x))
        return RaceVerdict(min(entrants, key=best.__getitem__), {k: round(t * 1e3, 4) for k, t in best.items()})

    @staticmethod
    def _time(kind: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
        """Seconds one call of `fn` (the entrant `kind`) takes."""
        start = time.perf_counter()
        fn(x)
        return time.perf_counter() - start

    def verify_model(self, layers: list[Any], rows: tuple[int, ...] = LOAD_TIME_ROWS) -> None:
        """Decide each distinct layer shape's kernel at the decode batch sizes `rows` now (load
        time): `layer.route(rows)` runs whichever checks its choice needs (cpu_kernels.PackedLinear)."""
        start = time.perf_counter()
        seen: set[tuple[int, int, bool]] = set()
        for p in layers:
            shape = (p.out_features, p.in_features, p.module.bias is not None)
            if shape in seen:
                continue
            seen.add(shape)
            for r in rows:
                p.route(r)
        self.load_seconds += time.perf_counter() - start

    # --- the sampler's draw -------------------------------------------------------------------

    def sampler_kernel_ok(self, name: str, kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          formula: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          probe: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """May the sampler's native kernel `name` (`kernel(rows [R, V], per_row [R]) -> [R]`)
        replace its torch `formula`? Verified on first ask: the same result on every probe row,
        `probe(logits, generator)` making the kernel's inputs from seeded logits."""
        verdict = self.sampler_kernels.get(name)
        if verdict is None:
            verdict = _verify_sampler_kernel(kernel, formula, probe)
            with self.lock:
                self.sampler_kernels[name] = verdict
        return verdict.identical

    # --- decode attention ---------------------------------------------------------------------

    def attention_ok(self, rows: int, heads: int, kv_heads: int, head_dim: int,
                     kernel: Callable[..., None]) -> bool:
        """May the kernel attend `rows` decode rows of this head layout? Verified on first ask.
        `kernel(q, k_pool, v_pool, idx, lens, out, scale)` runs the native kernel unchecked."""
        key = (heads, kv_heads, head_dim)
        verdict = self.attention.get(key)
        if verdict is None:
            verdict = _verify_attention(heads, kv_heads, head_dim, kernel)
            with self.lock:
                self.attention[key] = verdict
        return verdict.single_row if rows == 1 else verdict.multi_row

    # --- what ran, for the engine config and the trace ----------------------------------------

    def report(self) -> dict[str, Any]:
        lo, hi, split_max = SPLIT_MAX_ROWS + 1, PACKED_MAX_ROWS, SPLIT_MAX_ROWS
        by_shape: dict[str, dict[str, list[int]]] = {}
        split: dict[str, dict[str, list[int]]] = {}
        reasons: list[str] = []
        sources: dict[str, list[str]] = {}
        for (n, k, bias, rows, threads, kind), v in sorted(self.linear.items()):
            name = f"{k}->{n}{' +bias' if bias else ''}"
            if kind == PACKED:
                entry = by_shape.setdefault(name, {"packed_rows": [], "refused_rows": []})
                entry["packed_rows" if v.identical else "refused_rows"].append(rows)
            else:
                entry = split.setdefault(name, {"split_rows": [], "refused_rows": []})
                entry["split_rows" if v.identical else "refused_rows"].append(rows)
            sources.setdefault(v.source, []).append(f"{name} at {rows} rows{'' if kind == PACKED else ' (split)'}")
            if not v.identical:
                reasons.append(f"{k}->{n} at {rows} rows ({threads} threads): {kind} differs from F.linear "
                               f"by up to {v.max_abs_diff:.3g}; F.linear is used")
        routes: dict[str, dict[str, dict[str, Any]]] = {}
        for (n, k, bias, rows, _threads, _entrants), v in sorted(self.races.items()):
            routes.setdefault(f"{k}->{n}{' +bias' if bias else ''}", {})[str(rows)] = {
                "ran": v.winner, "ms": v.ms, "source": v.source}
        sampler = {name: (f"kernel: the same result as the torch formula on all {v.rows} probe rows" if v.identical
                          else f"torch: the kernel differed from the formula on {v.mismatches} of {v.rows} probe rows")
                   for name, v in sorted(self.sampler_kernels.items())}
        attention = {}
        for (h, kvh, d), v in self.attention.items():
            attention[f"{h}x{kvh}x{d}"] = {
                "single_row": "kernel (bit-identical to the torch path)" if v.single_row else
                f"torch: the kernel differs from it by up to {v.single_row_max_diff:.3g} at one row, "
                "where the torch path is exactly transformers' attention",
                "multi_row": (f"kernel: within {ATTENTION_ERROR_FACTOR:g}x sdpa's own error (kernel "
                              f"{v.kernel_error:.3g}, sdpa {v.torch_error:.3g} vs float64); sdpa's bits "
                              "here depend on the batch's padding, so no result to be identical to")
                if v.multi_row else
                ("torch: WORKBENCH_CPU_KERNELS=exact and the kernel is not bit-identical" if exact_only() else
                 f"torch: kernel error {v.kernel_error:.3g} exceeds {ATTENTION_ERROR_FACTOR:g}x sdpa's "
                 f"{v.torch_error:.3g}"),
                "check_seconds": round(v.seconds, 3)}
        return {"policy": "exact" if exact_only() else "packed or split GEMM only where bit-identical to F.linear "
                "(per shape and row count, checked on this CPU), and only where faster; decode attention as "
                "the report says",
                "packed_linear": {"shapes": by_shape, "refused": reasons, "verdicts": sources,
                                  "verdict_file": str(self.store.path) if self.store is not None else None,
                                  "unchecked_rows": "verified on first use, then kept for the process"
                                  + (" and in the verdict file" if self.store is not None else ""),
                                  "packing": f"each layer's weight is packed on its second packed call "
                                  f"({lo}-{hi} rows where the split GEMM is not used; a command that never "
                                  "runs such batches never packs)",
                                  "load_check_seconds": round(self.load_seconds, 3)},
                "split_linear": {"shapes": split,
                                 "how": f"1-{split_max} rows (decode batches): the weight's "
                                 "output rows split into one slice per thread, one GEMM each in parallel "
                                 "(torch.bmm over the slices), used only where identical to F.linear; "
                                 "refusals are listed under packed_linear.refused"},
                "linear_routes": {"shapes": routes,
                                  "how": "what ran per shape and row count: the fastest of F.linear and the "
                                  f"kernels identical to it, timed on this CPU (best of {RACE_REPEATS} calls "
                                  "each, ms)"},
                "attention": attention,
                "sampler_kernels": sampler}


def _verify_sampler_kernel(kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           formula: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           probe: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
                           ) -> DrawVerdict:
    gen = torch.Generator().manual_seed(11)
    rows = mismatches = 0
    for vocab, temp in ((49152, 1.0), (49152, 0.2), (32000, 3.0), (7, 1.0), (1000, 0.05)):
        logits = torch.randn(16, vocab, generator=gen) * 4 / temp
        logits[:4, vocab // 3:] = float("-inf")  # rows whose tail was cut (top-k / top-p): zeros
        x, per_row = probe(logits, gen)
        got, want = kernel(x, per_row), formula(x, per_row)
        rows += 16
        mismatches += int((got != want).sum())
    return DrawVerdict(mismatches == 0, rows, mismatches)


def _probe(rows: int, in_features: int) -> torch.Tensor:
    """The checks' seeded input: activations of both signs and a spread of magnitudes, like a hidden state."""
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen).mul(8)


def _torch_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor,
                  lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention.py's torch path computes for decode rows: gather, masked sdpa. [B, H, D]"""
    b, length = idx.shape
    shape = (b, length, *k_pool.shape[1:])
    k = k_pool.index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
    v = v_pool.index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]


def _verify_attention(heads: int, kv_heads: int, head_dim: int, kernel: Callable[..., None]) -> AttentionVerdict:
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + head_dim)
    scale = head_dim ** -0.5
    single_diff, kernel_err, torch_err = 0.0, 0.0, 0.0
    # one row at a few lengths, then padded batches as the engine builds them (mixed lengths)
    cases = [torch.tensor([n]) for n in (1, 7, 130)] + [torch.tensor([1, 40, 17, 200, 3, 99, 64, 128])]
    with torch.inference_mode():
        for lens in cases:
            b, length = len(lens), int(lens.max())
            k_pool = torch.randn(b * length + 1, kv_heads, head_dim, generator=gen)
            v_pool = torch.randn(b * length + 1, kv_heads, head_dim, generator=gen)
            idx = (torch.randperm(b * length, generator=gen) + 1).view(b, length)
            idx = idx * (torch.arange(length)[None, :] < lens[:, None])  # padded positions read slot 0
            q = torch.randn(b, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
            out = torch.empty_like(q)
            kernel(q, k_pool, v_pool, idx, lens, out, scale)
            ref = _torch_decode(q, k_pool, v_pool, idx, lens, scale)
            if b == 1:
                single_diff = max(single_diff, float((out - ref).abs().max()))
                continue
            exact = _torch_decode(q.double(), k_pool.double(), v_pool.double(), idx, lens, scale)
            kernel_err = max(kernel_err, float((out.double() - exact).abs().max()))
            torch_err = max(torch_err, float((ref.double() - exact).abs().max()))
            if exact_only() and not torch.equal(out, ref):
                kernel_err = max(kernel_err, float("inf"))
    multi = kernel_err <= ATTENTION_ERROR_FACTOR * torch_err
    return AttentionVerdict(single_diff == 0.0, multi, single_diff, kernel_err, torch_err,
                            time.perf_counter() - start)


CHECKS = FastPathChecks(default_store())  # this process's verdicts (the default every packed layer and kernel call uses)
