"""A decoder layer's small ops in one C call each (c/layer_ops.c), and their checks.

Owns: `LayerOps`, what the direct forward (run/exact_forward.py) calls in place of transformers'
RMSNorm forward with the residual add before it (`norm.rms`) and of `apply_rotary_pos_emb`
(`rotary.apply`): each of those is five to fourteen torch ops on a few hundred floats a row, paid
mostly in dispatch (BENCHMARKS.md, "the model's other ops"). Both compute torch's own arithmetic:

- the norm's mean is torch's float sum, whose order (ATen's SumKernel: four-vector cascades of
  `lanes`-wide vectors, then the lanes in turn) depends on the vector width torch picked on this
  CPU; the widths in `NORM_LANES` are tried on probe rows against the model's own norm module and
  the first that matches every probe is kept (`lanes` in the verdict's facts), else the norm is
  refused and transformers' ops run;
- the rotation is elementwise (two rounded products, one rounded sum), checked against the model's
  own `apply_rotary_pos_emb` on probes;
- the MLP's `act_fn(gate) * up` (`mlp.silu_mul`) for a SiLU activation: torch's vectorized SiLU,
  `x / (1 + exp(-x))` with SLEEF's expf_u10, then the product; checked against the model's own
  activation module on probes (under- and overflow, infinities, NaN included).

Does not own: when the direct forward may run at all (exact_forward.py) or the build (native.py).
"""

from __future__ import annotations

import torch

from workbench.engine.kernels import native
from workbench.engine.kernels.book import BOOK, Book
from workbench.engine.kernels.verdict import Verdict

NORM, ROPE, SILU_MUL = "norm.rms", "rotary.apply", "mlp.silu_mul"
NORM_LANES = (8, 16, 4)  # torch's Vectorized<float> width: AVX2 (its sum kernel's, on AVX512 CPUs too), AVX512
PROBE_ROWS = (1, 5, 64)


def _probes(n: int, seed: int) -> list[torch.Tensor]:
    """Rows spanning six decades of scale (the sum's rounding differs with magnitude), with signs."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, rows, n, generator=gen) * torch.logspace(-3, 3, rows)[None, :, None]
            for rows in PROBE_ROWS]


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[1, T, H * D]` as the `[1, H, T, D]` view transformers' attention takes."""
    return t.view(1, t.shape[1], -1, head_dim).transpose(1, 2)


def _norm_key(module: torch.nn.Module) -> tuple:
    return (type(module).__qualname__, int(module.weight.shape[0]), float(module.variance_epsilon))


class LayerOps:
    """The fused norm and rotation for one model, where their checks passed on this CPU."""

    def __init__(self, rotate, book: Book = BOOK) -> None:
        self.rotate, self.book = rotate, book
        self.lanes: dict[tuple, int | None] = {}  # norm key -> the checked lanes (None: refused)
        self.rope_ok: dict[tuple, bool] = {}
        self.act_ok: dict[tuple, bool] = {}  # activation class -> mlp.silu_mul passed

    @classmethod
    def for_model(cls, model: torch.nn.Module, rotate, book: Book = BOOK) -> LayerOps | None:
        """None where the C kernels are unavailable or the model is not CPU float32."""
        param = next(model.parameters(), None)
        if native.load() is None or param is None or param.dtype != torch.float32 or param.device.type != "cpu":
            return None
        return cls(rotate, book)

    # --- the norm ---------------------------------------------------------------------------------

    def _norm_lanes(self, module: torch.nn.Module) -> int | None:
        key = _norm_key(module)
        if key not in self.lanes:
            verdict = self.book.decide(NORM, key, lambda: self._check_norm(module))
            self.lanes[key] = int(verdict.facts["lanes"]) if verdict.ok else None
        return self.lanes[key]

    def _norm_c(self, module: torch.nn.Module, x: torch.Tensor, delta: torch.Tensor | None,
                lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        total = None
        if delta is not None:
            delta = delta.contiguous()
            total = torch.empty_like(x)
        weight = module.weight.detach()
        native.load().wb_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                             None if total is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                             x.numel() // n, n, module.variance_epsilon, lanes)
        return (x if total is None else total), out

    def norm(self, module: torch.nn.Module, x: torch.Tensor,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(h, module(h))` with `h = x + delta` (or `x`): the residual stream and its norm, as
        transformers computes them, in one call where `norm.rms` passed, else through torch."""
        lanes = self._norm_lanes(module) if native.load() is not None else None
        if lanes is None or x.dtype != torch.float32 or (delta is not None and delta.shape != x.shape):
            h = x if delta is None else x + delta
            return h, module.forward(h)
        return self._norm_c(module, x, delta, lanes)

    def _check_norm(self, module: torch.nn.Module) -> Verdict:
        n = int(module.weight.shape[0])
        if module.weight.dtype != torch.float32 or not hasattr(module, "variance_epsilon"):
            return Verdict(False, "torch: not a float32 RMSNorm with variance_epsilon", {})
        probes = _probes(n, n)

        def matches(lanes: int) -> bool:  # the residual add and the norm, on every probe
            for p in probes:
                h, out = self._norm_c(module, p, p.flip(1), lanes)
                if not (torch.equal(h, p + p.flip(1)) and torch.equal(out, module.forward(p + p.flip(1)))):
                    return False
            return True

        with torch.inference_mode():
            for lanes in NORM_LANES:
                if matches(lanes):
                    return Verdict(True, f"kernel: bit-identical to {type(module).__name__}.forward and the residual "
                                   f"add on {len(probes)} probes, torch's sum at {lanes} lanes",
                                   {"lanes": lanes, "probe_rows": list(PROBE_ROWS)})
        return Verdict(False, f"torch: no listed sum order ({', '.join(map(str, NORM_LANES))} lanes) gives "
                       f"{type(module).__name__}'s bits on this CPU", {})

    # --- the rotation -----------------------------------------------------------------------------

    def _rope_c(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[1, T, Hq * D]`, k `[1, T, Hk * D]` (rows may be strided), cos/sin `[1, T, D]` ->
        contiguous rotated copies of q and k."""
        rows = q.shape[1]
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k.stride(-1) != 1:
            k = k.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        qo = torch.empty((1, rows, q.shape[-1]), dtype=torch.float32)
        ko = torch.empty((1, rows, k.shape[-1]), dtype=torch.float32)
        native.load().wb_rope(q.data_ptr(), k.data_ptr(), q.stride(1), k.stride(1), cos.data_ptr(), sin.data_ptr(),
                         qo.data_ptr(), ko.data_ptr(), rows, q.shape[-1] // head_dim, k.shape[-1] // head_dim,
                         head_dim)
        return qo, ko

    def rope_fits(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        if native.load() is None:
            return False
        key = (heads, kv_heads, head_dim)
        if key not in self.rope_ok:
            self.rope_ok[key] = self.book.decide(ROPE, key, lambda: self._check_rope(*key)).ok
        return self.rope_ok[key]

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[1, T, Hq * D]` and k `[1, T, Hk * D]` rotated as `apply_rotary_pos_emb` rotates their
        `[1, H, T, D]` views; returned as those views. The caller asked `rope_fits` first."""
        qo, ko = self._rope_c(q, k, cos, sin, head_dim)
        return _heads(qo, head_dim), _heads(ko, head_dim)

    def _check_rope(self, heads: int, kv_heads: int, head_dim: int) -> Verdict:
        if head_dim % 2:
            return Verdict(False, "torch: an odd head_dim", {})
        gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 10 + head_dim)
        with torch.inference_mode():
            for rows in PROBE_ROWS:
                q = torch.randn(1, rows, heads * head_dim, generator=gen)
                k = torch.randn(1, rows, kv_heads * head_dim, generator=gen)
                angle = torch.rand(1, rows, head_dim, generator=gen) * 1000
                cos, sin = angle.cos(), angle.sin()
                want_q, want_k = self.rotate(_heads(q, head_dim), _heads(k, head_dim), cos, sin)
                got_q, got_k = self.rope(q, k, cos, sin, head_dim)
                if not (torch.equal(got_q, want_q) and torch.equal(got_k, want_k)):
                    return Verdict(False, "torch: the kernel's rotation differs from apply_rotary_pos_emb "
                                   f"at {rows} rows", {})
        return Verdict(True, f"kernel: bit-identical to apply_rotary_pos_emb on {len(PROBE_ROWS)} probes",
                       {"probe_rows": list(PROBE_ROWS)})

    # --- the MLP's activation ---------------------------------------------------------------------

    def silu_mul_ok(self, act_fn: torch.nn.Module) -> bool:
        """Does `silu_mul` run the C pass for this activation module (its class's check passed, and
        no notebook gave this module its own forward)?"""
        key = (type(act_fn).__qualname__,)
        ok = self.act_ok.get(key)
        if ok is None and native.load() is not None:
            ok = self.act_ok[key] = self.book.decide(SILU_MUL, key, lambda: self._check_silu_mul(act_fn)).ok
        return bool(ok) and native.load() is not None and "forward" not in vars(act_fn)

    def silu_mul(self, act_fn: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """`act_fn(gate) * up` (LlamaMLP's), in one C pass where `mlp.silu_mul` passed for this
        activation's class, else through torch."""
        if not self.silu_mul_ok(act_fn) or gate.dtype != torch.float32 or up.dtype != torch.float32 \
                or gate.shape != up.shape:
            return act_fn.forward(gate) * up
        return self._silu_mul_c(gate, up)

    @staticmethod
    def _silu_mul_c(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        native.load().wb_silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
        return out

    def _check_silu_mul(self, act_fn: torch.nn.Module) -> Verdict:
        """Against the module itself on probes spanning nine decades, both signs, the range where
        exp under- and overflows, +-0, +-inf and NaN; sizes on both sides of the threaded cut."""
        gen = torch.Generator().manual_seed(7)
        with torch.inference_mode():
            for n in (1536, 65536):
                gate = torch.randn(n, generator=gen) * torch.logspace(-4, 5, n)[torch.randperm(n, generator=gen)]
                gate[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.8, -103.9, -104.5])
                gate[8:264] = torch.linspace(-120, 120, 256)
                up = torch.randn(n, generator=gen)
                want, got = act_fn.forward(gate) * up, self._silu_mul_c(gate, up)
                same = (want == got) | (want.isnan() & got.isnan())
                if not bool(same.all()):
                    return Verdict(False, f"torch: the kernel differs from {type(act_fn).__name__} times up on "
                                   f"{int((~same).sum())} of {n} probe values", {})
        return Verdict(True, f"kernel: bit-identical to {type(act_fn).__name__}(gate) * up on 2 probes "
                       "(SLEEF's expf_u10, as torch's vectorized SiLU)", {"probe_sizes": [1536, 65536]})
