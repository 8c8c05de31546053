"""Every decoder layer at one decode row in one C call (`forward.decode_layers`).

At batch 1 the direct forward (run/exact_forward.py) makes ~15 Python calls a layer around kernels
that are each already checked bit-identical to what they replace: the norms (`norm.rms`), the
grouped projections (`linear.rowdot`), the rotation (`rotary.apply`), the KV write, the flash
replay (`attention.flash_one_row`) and SiLU*up (`mlp.silu_mul`). `DecodeLayers` binds those same
kernels, with the arguments the Python path passes them, into one call of
`wb_decode_layers` (kernels/c/decode_layers.c) per step.

Used only where the Python path would call exactly those kernels this step: one decode row on
consecutive KV slots, nothing captured, the engine's own attention function registered, no sliding
window, no per-head q/k norms, every projection routed to the one-row kernel with its order
checked, every norm's and the activation's check passed, the C decode kernel refused and the flash
replay passed for this head layout and thread count. Anything else (a notebook's hook, a replaced
forward or weight, another thread count) and the Python path runs, as before.

The composed call is itself checked once per model object, in the process (the caller's `check`:
run/exact_forward.py `verify_decode_layers`, a one-row decode on scratch KV through both paths,
logits and every layer's K/V compared bit for bit). Where a kernel it needs was refused, its verdict
says which and why, and the Python path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from workbench.engine.kernels import decode_attention, native
from workbench.engine.kernels.book import BOOK, model_environment
from workbench.engine.kernels.registry import REGISTRY
from workbench.engine.kernels.verdict import Verdict

NAME = "forward.decode_layers"
NAME_ROWS = "forward.decode_layers_rows"


class _Order(ctypes.Structure):
    _fields_ = [("peel", ctypes.c_int64), ("lanes", ctypes.c_int64), ("fma", ctypes.c_int64)]


_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("lanes1", ctypes.c_int64), ("lanes2", ctypes.c_int64),
                *[(n, _P) for n in ("wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "wg", "bg", "wu", "bu", "wd", "bd")],
                ("qkv", _Order), ("o", _Order), ("gate_up", _Order), ("down", _Order),
                ("k_pool", _P), ("v_pool", _P), ("scale", ctypes.c_float)]


_SCRATCH = ("x", "q", "k", "v", "qr", "kr", "attn", "o", "gate", "up", "act")


class _Shape(ctypes.Structure):
    _fields_ = [*[(n, ctypes.c_int64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "flash_lanes")],
                ("threads", ctypes.c_int), *[(n, _P) for n in _SCRATCH]]


class _Blocked(ctypes.Structure):  # (KC, bias first), and past `head` rows the one-row order (gemm.py split orders)
    _fields_ = [(n, ctypes.c_int64) for n in ("kc", "bias_first", "head", "peel", "lanes", "fma")]


_LINEARS = (("q", "self_attn", "q_proj"), ("k", "self_attn", "k_proj"), ("v", "self_attn", "v_proj"),
            ("o", "self_attn", "o_proj"), ("g", "mlp", "gate_proj"), ("u", "mlp", "up_proj"), ("d", "mlp", "down_proj"))


class _LayerRows(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("lanes1", ctypes.c_int64), ("lanes2", ctypes.c_int64),
                *[(n, _P) for n in ("wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "wg", "bg", "wu", "bu", "wd", "bd")],
                *[(n, _Blocked) for n, _, _ in _LINEARS],
                ("k_pool", _P), ("v_pool", _P), ("scale", ctypes.c_float)]


class _ShapeRows(ctypes.Structure):
    _fields_ = [*[(n, ctypes.c_int64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "slots")],
                ("threads", ctypes.c_int), *[(n, _P) for n in _SCRATCH]]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLayers:
    """One model's layers bound to the C call; `run` returns None wherever the Python path must run."""

    def __init__(self) -> None:
        self.plan: tuple | None = None  # (key, layers array or None, shape struct or why not, scratch, what
        # `_current` compares, the KV pool it binds)
        self.plans: dict[int, tuple] = {}  # decode rows -> the plan of `_run_rows` (as `plan`)
        self.mode = "checked"  # "python" inside its own check's reference forwards, "unchecked" for its C one
        self.calls = 0  # C calls made (the check asks whether its own forward made one)
        # the plan and its scratch buffers are one per model: a second thread running the same model
        # (two engines on one loaded model) takes the Python path while the first is in here
        self.lock = threading.RLock()

    def run(self, model: torch.nn.Module, fb: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            count: int, ops: Any, plain: bool, structure: int,
            check: Callable[[int], Verdict], model_hash: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(residual, pending)` after the first `count` layers (what the Python loop leaves for
        the final norm), or None (nothing written anywhere) where this step is not one the C call
        may take. `plain`: the caller's layers attend with the engine's own attention function and
        no sliding window; `structure`: a count that moves when any submodule is assigned; `check(rows)`:
        the composed call against the Python path at that many decode rows (run/exact_forward.py),
        run once per model object and row count; `model_hash`: the loaded folder's content hash,
        under which a passed check is kept on disk (`environment`), or None (this process only)."""
        if self.mode == "python" or not plain or fb.capture is not None:
            return None
        if not self.lock.acquire(blocking=False):  # (re-entered by its own check: an RLock)
            return None
        try:
            if hidden.shape[-2] == 1:
                return self._run(model, fb, hidden, cos, sin, count, ops, structure, lambda: check(1), model_hash)
            return self._run_rows(model, fb, hidden, cos, sin, count, ops, structure, check, model_hash)
        finally:
            self.lock.release()

    def _run(self, model: torch.nn.Module, fb: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             count: int, ops: Any, structure: int, check: Callable[[], Verdict],
             model_hash: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = fb.attn
        if meta.extend_rows or meta.decode_run is None or meta.decode_kv_idx is None or meta.decode_kv_idx.shape[0] != 1:
            return None
        if torch.is_grad_enabled() or hidden.dtype != torch.float32:
            return None
        kv = fb.memory.kv
        threads = torch.get_num_threads()
        cfg = model.config
        heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        layout = (heads, kv_heads, int(kv.k[0].shape[-1]))
        if not decode_attention.refused(1, *layout):  # the Python path calls the C decode kernel, if it may
            one_row = BOOK.tables.get(decode_attention.ONE_ROW, {}).get(layout)
            if one_row is not None and one_row.ok:  # it may (its check passed here): say why, once
                BOOK.decide(NAME, (threads,), lambda: Verdict(
                    False, f"Python path: {decode_attention.ONE_ROW} passed its check here and runs in place of "
                    "the flash replay this call makes", {}), about=model)
            return None
        key = (structure, threads, count, kv.k[0].data_ptr())

        def current() -> tuple:
            plan = self.plan
            # the pool itself, not only an address: a new engine's pool may reuse the old one's first
            # layer's address while its other layers moved
            if plan is None or plan[0] != key or plan[5]() is not kv or not _current(plan):
                plan = self.plan = _make(model, ops, kv, threads, count, key)
            return plan

        if self.mode != "unchecked" and not BOOK.decide(NAME, (threads,), lambda: self._decide(current(), check),
                                                        about=model,
                                                        env=lambda: environment(NAME, model, model_hash, current())).ok:
            return None
        plan = current()
        if plan[1] is None:
            return None  # passed before, refused since (a notebook swapped a layer or a weight): Python
        shape = plan[2]
        res = hidden.clone(memory_format=torch.contiguous_format)
        pending = torch.empty_like(res)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = native.load().wb_decode_layers(ctypes.addressof(plan[1]), count, ctypes.addressof(shape), res.data_ptr(),
                                            pending.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                            int(fb.out_cache_loc[0]), meta.decode_run, meta.decode_kv_idx.shape[1])
        if rc == -3:
            raise MemoryError("decode layers: out of memory for the flash kernel's scratch")
        if rc:
            raise RuntimeError(f"decode layers: a kernel refused arguments the plan checked (code {rc})")
        self.calls += 1
        return res, pending

    @staticmethod
    def _decide(plan: tuple, check: Callable[[], Verdict]) -> Verdict:
        return Verdict(False, f"Python path: {plan[2]}", {}) if plan[1] is None else check()

    def _run_rows(self, model: torch.nn.Module, fb: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  count: int, ops: Any, structure: int, check: Callable[[int], Verdict],
                  model_hash: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Several decode rows (a decode-only batch) in one call of `wb_decode_layers_rows`, where
        every projection's blocked kernel passed its check at this row count (bit-identical to
        F.linear, so to whatever the projection's own race picked) and the batch attention kernel
        runs for this head layout: what the Python path computes, one call a layer each."""
        meta, rows = fb.attn, hidden.shape[-2]
        idx, lens, loc = meta.decode_kv_idx, meta.decode_lens, fb.out_cache_loc
        if meta.extend_rows or idx is None or meta.decode_start != 0 or idx.shape[0] != rows \
                or torch.is_grad_enabled() or hidden.dtype != torch.float32 or idx.dtype != torch.int64 \
                or idx.stride(1) != 1 or lens.dtype != torch.int64 or not lens.is_contiguous() \
                or loc.dtype != torch.int64 or not loc.is_contiguous() or loc.shape[0] != rows:
            return None
        kv = fb.memory.kv
        threads = torch.get_num_threads()
        key = (structure, threads, count, kv.k[0].data_ptr(), rows)

        def current() -> tuple:
            plan = self.plans.get(rows)
            if plan is None or plan[0] != key or plan[5]() is not kv or not _current(plan):
                plan = self.plans[rows] = _make_rows(model, ops, kv, threads, count, rows, key)
            return plan

        if self.mode != "unchecked" and not BOOK.decide(NAME_ROWS, (threads, rows),
                                                        lambda: self._decide(current(), lambda: check(rows)),
                                                        about=model,
                                                        env=lambda: environment(NAME_ROWS, model, model_hash, current())).ok:
            return None
        plan = current()
        if plan[1] is None:
            return None
        res = hidden.clone(memory_format=torch.contiguous_format)
        pending = torch.empty_like(res)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = native.load().wb_decode_layers_rows(ctypes.addressof(plan[1]), count, ctypes.addressof(plan[2]), rows,
                                                 res.data_ptr(), pending.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                                 loc.data_ptr(), idx.data_ptr(), idx.stride(0), lens.data_ptr())
        if rc == -2:
            raise IndexError("decode layers: a KV slot index or a row length is outside the pool / slot table")
        if rc:
            raise RuntimeError(f"decode layers: a kernel refused arguments the plan checked (code {rc})")
        self.calls += 1
        return res, pending


def environment(name: str, model: torch.nn.Module, model_hash: str | None, plan: tuple) -> dict[str, str] | None:
    """What a passed check of the composed call holds for, kept on disk under it: the machine (CPU,
    libraries, instruction set), the model (its folder's content hash, config, class and modeling
    code), this module's code and the plan's every choice but its addresses (`_choices`: each norm's
    lanes and eps, each projection's summation order, the attention kernel's lanes, the shapes): a
    process whose other verdicts make another plan checks again. None where no model hash is known
    or the plan is a refusal: the verdict stays in this process."""
    if model_hash is None or plan[1] is None:
        return None
    return {**BOOK.environment(REGISTRY[name]), **model_environment(name, model, model_hash),
            "plan_sha256": hashlib.sha256(repr(_choices(plan)).encode()).hexdigest()}


def _choices(plan: tuple) -> list:
    """The plan's structs as values: every number and order, and for each pointer only whether it is
    set (a bias or not); the pool's slot count and the scratch buffers are left out."""
    def values(struct: ctypes.Structure) -> list:
        out = []
        for name, kind in struct._fields_:
            v = getattr(struct, name)
            if name == "slots" or name in _SCRATCH:
                continue
            out.append((name, values(v) if isinstance(v, ctypes.Structure) else v is not None if kind is _P else v))
        return out

    return [values(s) for s in plan[1]] + [values(plan[2])]


class _Watched:
    """What `_current` compares, as flat lists the comparisons map over in C: each watched module's
    `__dict__` and the `forward` it held, each parameter's dict, name, tensor (or None) and, for the
    tensors, their addresses, and (where the plan binds routes) each projection's route dict, the key
    it looks up and the `route` it must still give."""

    def __init__(self, seen: tuple[list, list, list], route: str) -> None:
        forwards, params, routes = seen
        self.route = route
        self.dicts, self.forwards = [d for d, _ in forwards], [f for _, f in forwards]
        self.param_dicts, self.names, self.tensors = [p for p, *_ in params], [n for _, n, *_ in params], \
            [t for _, _, t, _ in params]
        self.live = [t for t in self.tensors if t is not None]
        self.ptrs = [ptr for _, _, t, ptr in params if t is not None]
        self.route_dicts, self.route_keys = [r for r, _ in routes], [k for _, k in routes]


_FORWARD = itertools.repeat("forward")
_data_ptr = torch.Tensor.data_ptr


def _current(plan: tuple) -> bool:
    """Is every tensor and forward the plan looked at still the one it found, at the same address,
    and (where the plan binds them) every projection still on the route it bound (the one-row kernel)? Asked
    every step (~1,000 comparisons for a 30-layer model): maps over flat lists, 0.19 ms a step as
    Python loops."""
    w: _Watched = plan[4]
    return all(map(operator.is_, map(dict.get, w.dicts, _FORWARD), w.forwards)) \
        and all(map(operator.is_, map(dict.get, w.param_dicts, w.names), w.tensors)) \
        and list(map(_data_ptr, w.live)) == w.ptrs \
        and (plan[1] is None or list(map(dict.get, w.route_dicts, w.route_keys)).count(w.route) == len(w.route_keys))


class _Binder:
    """What a plan binds, and what it watches: each module it reads is recorded (its forward, its
    parameters and their addresses, and with a `route_key` its linear's route there) for `_current`
    to compare every step. `route` is the route each watched linear must still have."""

    def __init__(self, model: torch.nn.Module, ops: Any, kv: Any, count: int, key: tuple, route_key: tuple | None,
                 route: str) -> None:
        cfg = model.config
        self.ops, self.kv, self.key, self.route_key = ops, kv, key, route_key
        self.layers = list(model.model.layers)[:count]
        self.seen: tuple[list, list, list] = ([], [], [])  # (dict, forward), (params, name, tensor, ptr), (routes, key)
        self.route = route
        self.hidden = int(cfg.hidden_size)
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)

    def why_not(self) -> str | None:
        """Why no plan can bind these layers (the first reason), or None."""
        kv, layers = self.kv, self.layers
        if native.load() is None or self.ops is None or not layers or kv.k[0].dtype != torch.float32 \
                or kv.k[0].device.type != "cpu":
            return "the C kernels, the layer ops or a float32 CPU KV pool are missing"
        d = int(layers[0].self_attn.head_dim)
        if not self.ops.rope_fits(self.heads, self.kv_heads, d) or tuple(kv.k[0].shape[1:]) != (self.kv_heads, d):
            return "rotary.apply was refused for this head layout"
        inter = int(layers[0].mlp.gate_proj.out_features)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not self.ops.silu_mul_ok(mlp.act_fn) or int(attn.head_dim) != d:
                return f"layer {i}: mlp.silu_mul was refused for its activation, or its head_dim differs"
            if attn.q_proj.out_features != self.heads * d or attn.k_proj.out_features != self.kv_heads * d \
                    or mlp.gate_proj.out_features != inter:
                return f"layer {i}: its projections' widths differ from the config's"
        return None

    def watch(self, module: torch.nn.Module) -> bool:
        forward = module.__dict__.get("forward")
        self.seen[0].append((module.__dict__, forward))
        for n, t in module._parameters.items():
            self.seen[1].append((module._parameters, n, t, t.data_ptr() if t is not None else 0))
        if self.route_key is not None and hasattr(forward, "_routes"):
            self.seen[2].append((forward._routes, self.route_key))
        return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in module._parameters.values())

    def norm(self, module: torch.nn.Module) -> tuple | str:
        lanes = self.ops._norm_lanes(module)
        if lanes is None or not self.watch(module) or module.weight.shape != (self.hidden,):
            return "norm.rms was refused for this norm"
        return module.weight, float(module.variance_epsilon), lanes

    def plan(self, structs: Any, shape: Any, scratch: dict[str, torch.Tensor] | None) -> tuple:
        """The plan: (key, the layers' structs, the shape struct, its scratch, what `_current` watches,
        the KV pool); with `structs` None, `shape` is why the Python path runs instead."""
        return self.key, structs, shape, scratch, _Watched(self.seen, self.route), weakref.ref(self.kv)

    def start(self) -> tuple | None:
        """The refusal plan where `why_not` finds a reason, else None (with `head_dim` and `inter` set)."""
        why = self.why_not()
        if why is not None:
            return self.plan(None, why, None)
        self.head_dim = int(self.layers[0].self_attn.head_dim)
        self.inter = int(self.layers[0].mlp.gate_proj.out_features)
        return None


def _make(model: torch.nn.Module, ops: Any, kv: Any, threads: int, count: int, key: tuple) -> tuple:
    """The bound arguments, or (key, None, ...) where some layer's Python path would not call the
    kernels the C call calls."""
    from workbench.engine.kernels.gemm import one_row_order

    bind = _Binder(model, ops, kv, count, key, (1, threads), "rowdot")
    layers, hidden, heads, kv_heads = bind.layers, bind.hidden, bind.heads, bind.kv_heads
    refusal = bind.start()
    if refusal is not None:
        return refusal
    refused = lambda why: bind.plan(None, why, None)  # noqa: E731
    lib, d, inter = native.load(), bind.head_dim, bind.inter
    flash = decode_attention.flash_lanes(heads, kv_heads, d, threads)
    if flash is None or not decode_attention._sgemm_ready(lib):
        return refused("attention.flash_one_row was refused for this head layout and thread count")

    def linears(name: str, *mods: torch.nn.Module) -> _Order | str:
        if not all([bind.watch(m) for m in mods]):
            return f"{name} is not a packed float32 linear"
        order = one_row_order(list(mods))
        if isinstance(order, str):
            return f"{name} {order}"
        return _Order(order[0], order[1], int(order[2]))

    structs = (_Layer * len(layers))()
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2 = bind.norm(layer.input_layernorm), bind.norm(layer.post_attention_layernorm)
        qkv = linears(f"layer {i}'s q/k/v", attn.q_proj, attn.k_proj, attn.v_proj)
        o, gate_up = linears(f"layer {i}'s o_proj", attn.o_proj), linears(f"layer {i}'s gate/up", mlp.gate_proj, mlp.up_proj)
        down = linears(f"layer {i}'s down_proj", mlp.down_proj)
        for part in (n1, n2, qkv, o, gate_up, down):
            if isinstance(part, str):
                return refused(part if part.startswith("layer") else f"layer {i}: {part}")
        s = structs[i]
        s.ln1, s.eps1, s.lanes1 = n1[0].data_ptr(), n1[1], n1[2]
        s.ln2, s.eps2, s.lanes2 = n2[0].data_ptr(), n2[1], n2[2]
        for name, lin in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                          ("g", mlp.gate_proj), ("u", mlp.up_proj), ("d", mlp.down_proj)):
            setattr(s, "w" + name, lin.weight.data_ptr())
            setattr(s, "b" + name, _ptr(lin.bias))
        s.qkv, s.o, s.gate_up, s.down = qkv, o, gate_up, down
        s.k_pool, s.v_pool = kv.k[i].data_ptr(), kv.v[i].data_ptr()
        s.scale = float(attn.scaling)
    scratch = {n: torch.empty(size) for n, size in
               zip(_SCRATCH, (hidden, heads * d, kv_heads * d, kv_heads * d, heads * d, kv_heads * d, heads * d, hidden,
                              inter, inter, inter))}
    shape = _Shape(hidden, heads, kv_heads, d, inter, flash, threads, *[t.data_ptr() for t in scratch.values()])
    return bind.plan(structs, shape, scratch)


def _make_rows(model: torch.nn.Module, ops: Any, kv: Any, threads: int, count: int, rows: int, key: tuple) -> tuple:
    """`_make` for `rows` decode rows: each projection bound with the blocked kernel's order its check
    found at this row count."""
    from workbench.engine.kernels.gemm import BLOCKED_MAX_ROWS, BLOCKED_MIN_ROWS, PackedLinear, split_order

    bind = _Binder(model, ops, kv, count, key, None, "")
    layers, hidden, heads, kv_heads = bind.layers, bind.hidden, bind.heads, bind.kv_heads
    refusal = bind.start()
    if refusal is not None:
        return refusal
    refused = lambda why: bind.plan(None, why, None)  # noqa: E731
    d, inter = bind.head_dim, bind.inter
    if not decode_attention.batch_fits(heads, kv_heads, d):
        return refused(f"{decode_attention.BATCH} was refused for this head layout")
    if not BLOCKED_MIN_ROWS <= rows <= BLOCKED_MAX_ROWS:
        return refused(f"linear.blocked does not run at {rows} rows")
    structs = (_LayerRows * len(layers))()
    for i, layer in enumerate(layers):
        s = structs[i]
        n1, n2 = bind.norm(layer.input_layernorm), bind.norm(layer.post_attention_layernorm)
        for part in (n1, n2):
            if isinstance(part, str):
                return refused(f"layer {i}: {part}")
        s.ln1, s.eps1, s.lanes1 = n1[0].data_ptr(), n1[1], n1[2]
        s.ln2, s.eps2, s.lanes2 = n2[0].data_ptr(), n2[1], n2[2]
        for name, owner, attr in _LINEARS:
            lin = getattr(getattr(layer, owner), attr)
            forward = lin.__dict__.get("forward")
            if not bind.watch(lin) or not isinstance(forward, PackedLinear):
                return refused(f"layer {i}'s {attr} is not a packed float32 linear")
            if not forward._blocked_ok(rows):
                return refused(f"layer {i}'s {attr}: linear.blocked was refused at {rows} rows")
            kc, bias_first, head, peel, lanes, fma = split_order(forward.blocked_orders[rows], rows)
            setattr(s, name, _Blocked(kc, int(bias_first), head, peel, lanes, int(fma)))
            setattr(s, "w" + name, lin.weight.data_ptr())
            setattr(s, "b" + name, _ptr(lin.bias))
        s.k_pool, s.v_pool = kv.k[i].data_ptr(), kv.v[i].data_ptr()
        s.scale = float(layer.self_attn.scaling)
    qd, kvd = heads * d, kv_heads * d
    scratch = {n: torch.empty(rows * size) for n, size in
               zip(_SCRATCH, (hidden, qd, kvd, kvd, qd, kvd, qd, hidden, inter, inter, inter))}
    shape = _ShapeRows(hidden, heads, kv_heads, d, inter, kv.k[0].shape[0], threads,
                       *[t.data_ptr() for t in scratch.values()])
    return bind.plan(structs, shape, scratch)
