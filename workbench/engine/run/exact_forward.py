"""The direct forward: transformers' own decoder forward, op for op, without the module dispatch.

Owns: `forward`, which calls the same torch ops on the same tensors in the same order as
`LlamaForCausalLM.forward` (or Mistral's, Qwen2's, Qwen3's: the same layer code plus a
`sliding_window` keyword and Qwen3's q/k norms; the container modules' bodies inlined; every leaf
module, the packed linears included, through its own `forward`; the attention function looked up
by name as transformers does), skipping `nn.Module.__call__`'s hook dispatch and transformers'
decorators (what they cost per step is in BENCHMARKS.md); and the three questions the runner asks
before using it:

- `refusal(model)`: only transformers' own classes of those four families (the containers' code
  is what is inlined here); anything else keeps the model's forward.
- `checked(...)`: the checked replacement `forward.direct` (engine/kernels/registry.py): three
  forwards (extend, mixed extend+decode, decode) on scratch KV through both paths (`verify`); the
  logits, every layer's K/V and the keywords each layer passes to attention must be identical.
  The verdict is kept per model object and, when passed, in the kernels' verdict store.
- `blocked(...)` per forward: a hook on any module (capture, a notebook's own hooks), training
  mode, or a container whose forward was replaced (fast mode's wrappers) means the model's own
  forward runs that step.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from workbench.engine.kernels import BOOK, Verdict
from workbench.engine.kernels.book import model_environment

DIRECT = "direct forward (transformers' decoder ops without module dispatch)"


@dataclass(frozen=True, slots=True)
class Family:
    """What a family's layer code adds to Llama's (read from its modeling file, transformers 5.x)."""

    prefix: str  # class-name prefix: "Llama" -> LlamaForCausalLM, LlamaModel, ...
    window: str | None  # the attention's sliding_window keyword: None (not passed), "layer" or "config"
    qk_norm: bool  # q_norm / k_norm on each head before RoPE (Qwen3)


FAMILIES = {"llama": Family("Llama", None, False), "mistral": Family("Mistral", "config", False),
            "qwen2": Family("Qwen2", "layer", False), "qwen3": Family("Qwen3", "layer", True)}


def _modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def refusal(model: torch.nn.Module) -> str | None:
    """Why the direct forward cannot stand in for `model`'s own (None: it can, pending `verify`)."""
    model_type = getattr(model.config, "model_type", None)
    fam = FAMILIES.get(model_type)
    if fam is None:
        return f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}, whose layer code it inlines"
    ml = _modeling(model_type)
    cls = lambda name: getattr(ml, fam.prefix + name)  # noqa: E731
    if type(model) is not cls("ForCausalLM"):
        return f"{type(model).__name__} is not transformers' {fam.prefix}ForCausalLM"
    inner = model.model
    if type(inner) is not cls("Model") or type(inner.norm) is not cls("RMSNorm"):
        return f"{type(inner).__name__} is not transformers' {fam.prefix}Model"
    if len(inner.layers) != int(model.config.num_hidden_layers):
        return "the model has a different number of layers than its config"
    want = (cls("DecoderLayer"), cls("Attention"), cls("MLP"))
    for layer in inner.layers:
        kinds = (type(layer), type(layer.self_attn), type(layer.mlp))
        if kinds != want:
            return f"layer {layer.self_attn.layer_idx} has {', '.join(k.__name__ for k in kinds)}"
    return None


_assignments = [0]  # submodules assigned anywhere in the process since import (see `assignments`)


def _count_assignment(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    _assignments[0] += 1


# torch calls this on every `parent.child = module` and `add_module` (global state, and cheap: a counter)
nn_module.register_module_module_registration_hook(_count_assignment)


def assignments() -> int:
    """How many submodule assignments the process has made: when it moves, a model's structure may
    have changed since `refusal` accepted it (a notebook swapping `layers[3].mlp`), so the runner
    asks `refusal` again before the next direct forward (any model built anywhere moves it too)."""
    return _assignments[0]


def containers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward bodies `forward` inlines."""
    inner = model.model
    out = [model, inner]
    for layer in inner.layers:
        out += [layer, layer.self_attn, layer.mlp]
    return out


def blocked(model: torch.nn.Module, modules: list[torch.nn.Module], inlined: list[torch.nn.Module]) -> str | None:
    """Why this forward must go through the model's own forward (None: the direct one may run)."""
    if model.training:
        return "the model is in training mode"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "a global forward hook is registered"
    # Every hook torch registers takes a RemovableHandle, whose class counter moves: where it has not
    # moved since a scan of these same modules found none, none was added (the scan, ~400 modules
    # read cold after a step that streamed the weights past the caches, took 0.35 ms of a 16-20 ms step)
    stamp = RemovableHandle.next_id
    seen = _hook_free.get(model)
    if seen is None or seen[0] is not modules or seen[1] != stamp:
        if any(map(len, map(_hooks, modules))) or any(map(len, map(_pre_hooks, modules))):
            return "a forward hook is registered"
        _hook_free[model] = (modules, stamp)
    if any(map(operator.contains, map(vars, inlined), itertools.repeat("forward"))):
        m = next(m for m in inlined if "forward" in vars(m))
        return f"{type(m).__name__}.forward was replaced"
    return None


_hooks, _pre_hooks = operator.attrgetter("_forward_hooks"), operator.attrgetter("_forward_pre_hooks")
# per model: the module list a scan last found hook-free, and RemovableHandle's counter then
_hook_free: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[torch.nn.Module], int]] = weakref.WeakKeyDictionary()


def forward(model: torch.nn.Module, fb: Any, layers: int | None = None) -> torch.Tensor:
    """`model(input_ids=..., position_ids=..., use_cache=False, logits_to_keep=fb.logits_rows,
    forward_batch=fb).logits[0]` (the call ModelRunner makes) as float32, for a model `refusal`
    accepts. `layers`: an early-exit draft's forward instead (ModelRunner._forward_early_exit: the
    first `layers` layers, then the final norm of the kept rows and the head)."""
    config = model.config
    fam = FAMILIES[config.model_type]
    ml = _modeling(config.model_type)
    inner = model.model
    attend = ml.ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ml.eager_attention_forward)
    rotate = ml.apply_rotary_pos_emb
    window = {} if fam.window is None else {"sliding_window": getattr(config, "sliding_window", None)}
    pos = fb.positions.unsqueeze(0)
    hidden = inner.embed_tokens.forward(fb.input_ids.unsqueeze(0))
    cos, sin = inner.rotary_emb(hidden, position_ids=pos)
    ops = _layer_ops(model, rotate)
    pending = None  # with `ops`: the last layer's MLP output, added to `hidden` inside the next norm
    count = config.num_hidden_layers if layers is None else layers
    # islice, not `layers[:n]` as transformers writes it: slicing a ModuleList builds a new one, whose
    # add_module calls count as submodule assignments (`assignments`), which would make the runner
    # re-read the model's structure before every forward (~1 ms a step on SmolLM2)
    todo = itertools.islice(inner.layers, count)
    if ops is not None and not fam.qk_norm:  # decode rows: every layer in one C call where it may
        fused = _decode_layers(model)
        from workbench.engine.run.attention import workbench_attention

        plain = attend is workbench_attention and _window_free(fam, window, inner.layers, count)
        done = fused.run(model, fb, hidden, cos, sin, count, ops, plain, assignments(),
                         lambda rows: verify_decode_layers(model, fused, fb.memory.kv, rows), _hashes.get(model))
        if done is not None:
            (hidden, pending), todo = done, ()
    for layer in todo:
        # LlamaDecoderLayer.forward
        if ops is None:
            residual = hidden
            hidden = layer.input_layernorm.forward(hidden)
        else:
            residual, hidden = ops.norm(layer.input_layernorm, hidden, pending)
        # LlamaAttention.forward (Qwen3: q/k normed per head; Mistral, Qwen2, Qwen3: sliding_window=)
        attn = layer.self_attn
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q, k, v = _project(attn, "q_proj", "k_proj", "v_proj", hidden)
        if fam.qk_norm:
            q = attn.q_norm.forward(q.view(hidden_shape)).transpose(1, 2)
            k = attn.k_norm.forward(k.view(hidden_shape)).transpose(1, 2)
            q, k = rotate(q, k, cos, sin)
        elif ops is not None and ops.rope_fits(q.shape[-1] // attn.head_dim, k.shape[-1] // attn.head_dim,
                                               attn.head_dim):
            q, k = ops.rope(q, k, cos, sin, attn.head_dim)
        else:
            q, k = rotate(q.view(hidden_shape).transpose(1, 2), k.view(hidden_shape).transpose(1, 2), cos, sin)
        v = v.view(hidden_shape).transpose(1, 2)
        if fam.window == "layer":
            window = {"sliding_window": attn.sliding_window}
        out, _ = attend(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling, **window, position_ids=pos,
                        use_cache=False, forward_batch=fb)
        out = out.reshape(*input_shape, -1).contiguous()
        if ops is None:
            hidden = residual + attn.o_proj.forward(out)
            residual = hidden
            hidden = layer.post_attention_layernorm.forward(hidden)
        else:
            residual, hidden = ops.norm(layer.post_attention_layernorm, residual, _project(attn, "o_proj", out)[0])
        # LlamaMLP.forward
        mlp = layer.mlp
        gate, up = _project(mlp, "gate_proj", "up_proj", hidden)
        act = mlp.act_fn.forward(gate) * up if ops is None else ops.silu_mul(mlp.act_fn, gate, up)
        hidden = _project(mlp, "down_proj", act)[0]
        if ops is None:
            hidden = residual + hidden
        else:
            hidden, pending = residual, hidden
    rows = fb.logits_rows
    if ops is not None:  # each row's norm is its own: only the kept rows are added and normed
        _, hidden = ops.norm(inner.norm, hidden[:, rows], None if pending is None else pending[:, rows])
        return _project(model, "lm_head", hidden)[0][0].float()
    if layers is not None:
        return model.lm_head.forward(inner.norm.forward(hidden[:, rows]))[0].float()
    hidden = inner.norm.forward(hidden)
    # LlamaForCausalLM.forward: slice_logits_to_keep with a 1-D index tensor, then the head
    return model.lm_head.forward(hidden[:, rows, :])[0].float()


def _window_free(fam: Family, window: dict[str, Any], layers: torch.nn.ModuleList, count: int) -> bool:
    """Does no layer attend over a sliding window (the C layers call has none)?"""
    if fam.window == "layer":
        return all(layer.self_attn.sliding_window is None for layer in itertools.islice(layers, count))
    return window.get("sliding_window") is None


_fused: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _decode_layers(model: torch.nn.Module) -> Any:
    """The model's layers bound to one C call at one decode row (kernels/decode_layers.py)."""
    fused = _fused.get(model)
    if fused is None:
        from workbench.engine.kernels.decode_layers import DecodeLayers

        fused = _fused[model] = DecodeLayers()
    return fused


def verify_decode_layers(model: torch.nn.Module, fused: Any, kv: Any, rows: int = 1) -> Verdict:
    """`forward.decode_layers`' check (and, at several `rows`, `forward.decode_layers_rows`'): a decode
    on scratch KV laid out as the engine's (the engine pool's head layout and dtype; at one row over
    consecutive slots after a prefill, at several over rows of different lengths whose cached K/V is
    seeded noise), through the Python path and through the C call; the logits and every layer's K/V
    at the new slots compared bit for bit."""
    from workbench.engine.run.forward_batch import ForwardMode, RowSpec, build_forward_batch
    from workbench.engine.sched.memory import Memory

    start = time.perf_counter()
    layers = len(kv.k)
    lengths = [39] if rows == 1 else [3 + (5 * r) % 11 for r in range(rows)]  # cached tokens a row
    memory = Memory(num_layers=layers, kv_heads=kv.k[0].shape[1], head_dim=kv.k[0].shape[2],
                    kv_tokens=sum(lengths) + rows + 8, max_running=rows, max_context_len=max(lengths) + 9,
                    dtype=kv.k[0].dtype, device="cpu")
    vocab = int(model.config.vocab_size)
    ids = [[(7919 * (i + 50 * r) + 13) % vocab for i in range(n + 1)] for r, n in enumerate(lengths)]
    slots = [memory.req_to_token_pool.allocate() for _ in lengths]
    names = [f"r{r}" for r in range(rows)]
    plans = (fused.plan, dict(fused.plans))
    calls = fused.calls
    try:
        with torch.inference_mode():
            fused.mode = "python"
            if rows == 1:
                forward(model, build_forward_batch(ForwardMode.EXTEND, [RowSpec(names[0], slots[0], 0, ids[0][:-1], 1)],
                                                   memory, "cpu"))
            else:  # each row's prefix: seeded K/V in slots of its own, no prefill (whose row count would race)
                gen = torch.Generator().manual_seed(rows)
                for a, n in zip(slots, lengths, strict=True):
                    memory.req_to_token_pool.req_to_token[a, :n] = memory.allocator.allocate(n)
                for pool in (*memory.kv.k, *memory.kv.v):
                    pool[1:] = torch.randn(pool[1:].shape, generator=gen).to(pool.dtype)
            step = build_forward_batch(ForwardMode.DECODE, [RowSpec(n, a, len(t) - 1, t[-1:], 1) for n, a, t in
                                                            zip(names, slots, ids, strict=True)], memory, "cpu")
            want = forward(model, step)
            loc = step.out_cache_loc
            want_kv = [(k.index_select(0, loc), v.index_select(0, loc)) for k, v in zip(memory.kv.k, memory.kv.v)]
            for k, v in zip(memory.kv.k, memory.kv.v):  # the C call must write them itself
                k.index_fill_(0, loc, float("nan"))
                v.index_fill_(0, loc, float("nan"))
            fused.mode = "unchecked"
            got = forward(model, step)
    finally:
        fused.mode = "checked"
        ran = fused.calls > calls
        fused.plan, fused.plans = plans  # the engine's pool's, not the scratch one's
    where = "a one-row decode over 40 keys" if rows == 1 else f"a {rows}-row decode over {min(lengths) + 1}-" \
        f"{max(lengths) + 1} keys a row"
    facts = {"seconds": round(time.perf_counter() - start, 3), "rows": rows}
    if not ran:
        return Verdict(False, f"Python path: the C call did not take the check's {where}", facts)
    if not torch.equal(got, want):
        diff = (got - want).abs().max().item()
        return Verdict(False, f"Python path: the C call's logits differ by up to {diff:.3g}", facts)
    for layer, (k, v) in enumerate(want_kv):
        if not (torch.equal(k, memory.kv.k[layer].index_select(0, loc))
                and torch.equal(v, memory.kv.v[layer].index_select(0, loc))):
            return Verdict(False, f"Python path: layer {layer}'s K/V written by the C call differ", facts)
    return Verdict(True, f"kernel: logits and all {layers} layers' K/V bit-identical to the Python path on {where}",
                   facts)


_groups: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _project(owner: torch.nn.Module, *names_and_input: Any) -> list[torch.Tensor]:
    """`owner.NAME.forward(x)` for each named linear layer of `owner` (its q/k/v projections, its gate
    and up ones, or one layer), in one call of the one-row kernel where each layer's own route is
    that kernel (kernels/gemm.py RowdotGroup: the same bits as its own call), else one by one."""
    *names, x = names_and_input
    linears = [getattr(owner, n) for n in names]
    out = None
    if x.shape[-2] == 1:
        groups = _groups.get(owner)
        if groups is None:
            groups = _groups[owner] = {}
        group = groups.get(names[0])
        if group is None:
            from workbench.engine.kernels.gemm import RowdotGroup

            group = groups[names[0]] = RowdotGroup()
        out = group(linears, x)
    return out if out is not None else [m.forward(x) for m in linears]


_ops: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _layer_ops(model: torch.nn.Module, rotate) -> Any:
    """The model's fused norm and rotation (kernels/layer_ops.py), None where the C kernels or the
    model's dtype rule them out; each op is still used only where its own check passed."""
    ops = _ops.get(model)
    if ops is None:  # asked again while None: the C kernels may be switched back on (native.c_kernels_off)
        from workbench.engine.kernels.layer_ops import LayerOps

        ops = LayerOps.for_model(model, rotate)
        if ops is not None:
            _ops[model] = ops
    return ops


_verify_lock = threading.Lock()
CHECK_FORWARDS = 3  # the model forwards `verify` runs (and the direct ones beside them)


def _same_call(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@contextlib.contextmanager
def _recorded_attention(name: str, fbs: set[int], calls: list) -> Iterator[None]:
    """While the block runs, the attention function registered as `name` also appends
    `(layer, keywords)` of every call made for a ForwardBatch whose id is in `fbs` (other engines'
    calls pass through unrecorded). The mask is not recorded: the engine's attention builds its own
    (variants.py refuses a model whose attention needs the model's)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS[name]

    def recording(module, query, key, value, attention_mask, **kw):
        if id(kw.get("forward_batch")) in fbs:
            calls.append((module.layer_idx, {n: x for n, x in kw.items() if n != "forward_batch"}))
        return base(module, query, key, value, attention_mask, **kw)

    with _verify_lock:
        AttentionInterface.register(name, recording)
        try:
            yield
        finally:
            AttentionInterface.register(name, base)


def verify(model: torch.nn.Module, own: Any, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           device: str) -> dict[str, Any]:
    """Run an extend, a mixed and a decode forward on scratch KV through `own` (the model's forward,
    ModelRunner's) and `forward`, and compare bit for bit the logits and the K/V written, and the
    keywords every layer passed to attention (a sliding window longer than these 16 tokens changes
    no number here, but it is a keyword). Returns `{"identical": bool, "forwards": n, "detail": str,
    "seconds": s}`."""
    from workbench.engine.run.forward_batch import ForwardMode, RowSpec, build_forward_batch
    from workbench.engine.sched.memory import Memory

    start = time.perf_counter()
    memory = Memory(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, kv_tokens=32, max_running=2,
                    max_context_len=32, dtype=dtype, device=device)
    vocab = int(model.config.vocab_size)
    ids = [(7919 * i + 13) % vocab for i in range(16)]  # spread over the vocabulary, deterministic
    a, b = memory.req_to_token_pool.allocate(), memory.req_to_token_pool.allocate()
    plan = [
        (ForwardMode.EXTEND, [RowSpec("a", a, 0, ids[:6], 1), RowSpec("b", b, 0, ids[6:10], 1, 3)]),
        (ForwardMode.MIXED, [RowSpec("a", a, 6, ids[10:13], 1), RowSpec("b", b, 4, ids[13:14], 1)]),
        (ForwardMode.DECODE, [RowSpec("a", a, 9, ids[14:15], 1), RowSpec("b", b, 5, ids[15:16], 1)]),
    ]
    assert len(plan) == CHECK_FORWARDS
    kv = memory.kv
    seconds = lambda: round(time.perf_counter() - start, 3)  # noqa: E731
    for n, (mode, rows) in enumerate(plan, 1):
        fb = build_forward_batch(mode, rows, memory, device)
        mine_calls: list = []
        their_calls: list = []
        with torch.inference_mode():
            with _recorded_attention(model.config._attn_implementation, {id(fb)}, mine_calls):
                mine = forward(model, fb)
            written = [(k.index_select(0, fb.out_cache_loc), v.index_select(0, fb.out_cache_loc))
                       for k, v in zip(kv.k, kv.v)]
            with _recorded_attention(model.config._attn_implementation, {id(fb)}, their_calls):
                theirs = own(fb)  # last, so the scratch KV the next forward reads is the model's own
        if not torch.equal(mine, theirs):
            diff = (mine - theirs).abs().max().item() if mine.shape == theirs.shape else float("nan")
            return {"identical": False, "forwards": n, "seconds": seconds(),
                    "detail": f"{mode.value} forward: logits differ from the model's forward by up to {diff:.3g}"}
        for layer, (k, v) in enumerate(written):
            if not (torch.equal(k, kv.k[layer].index_select(0, fb.out_cache_loc))
                    and torch.equal(v, kv.v[layer].index_select(0, fb.out_cache_loc))):
                return {"identical": False, "forwards": n, "seconds": seconds(),
                        "detail": f"{mode.value} forward: layer {layer}'s K/V differ from the model's forward"}
        if [layer for layer, _ in mine_calls] != [layer for layer, _ in their_calls]:
            return {"identical": False, "forwards": n, "seconds": seconds(),
                    "detail": f"{mode.value} forward: attention ran for layers {[c[0] for c in mine_calls]}, "
                              f"the model's forward for {[c[0] for c in their_calls]}"}
        for (layer, mine_kw), (_, their_kw) in zip(mine_calls, their_calls):
            if not _same_call(mine_kw, their_kw):
                return {"identical": False, "forwards": n, "seconds": seconds(),
                        "detail": f"{mode.value} forward: layer {layer}'s attention keywords {sorted(mine_kw)} "
                                  f"differ from the model's forward's {sorted(their_kw)}"}
    return {"identical": True, "forwards": len(plan), "seconds": seconds(),
            "detail": "logits, every layer's K/V and attention keywords bit-identical to the model's forward on "
                      "an extend, a mixed and a decode forward"}


NAME = "forward.direct"  # its entry in engine/kernels/registry.py
# each model object's folder content hash, from `checked`: the one-call layers' verdicts are kept on
# disk under it (kernels/decode_layers.py `environment`)
_hashes: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def checked(model: torch.nn.Module, content_hash: str, check: Any) -> Verdict:
    """The verdict on the direct forward for `model` (`check()` returns a `verify` result): kept for
    this model object, else kept on disk by an earlier load of this same model, code and libraries
    (passed checks only: a model that failed is checked again on every load), else checked now."""
    _hashes[model] = content_hash
    def run() -> Verdict:
        result = check()
        return Verdict(result["identical"], result["detail"],
                       {"forwards": result["forwards"], "seconds": result["seconds"]})

    return BOOK.decide(NAME, (content_hash,), run, about=model, env=lambda: model_environment(NAME, model, content_hash))
