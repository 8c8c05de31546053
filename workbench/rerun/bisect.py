"""`workbench bisect T --at REQ:POS [--against NUMERICS]`: the first layer, and the sub-block in it,
that adds error beyond its dtype's floor.

Owns: reading the sequence (the request's prompt and its output tokens before POS), running it
twice through this engine's runner (engine/layer_walk.py: once in the reference numerics, float32 with
exact kernels, once in the numerics under suspicion) and attributing the difference at the row
that chose token POS, per decoder layer:

- **total**: how far the suspect's residual after the layer is from the reference's;
- **added**: the layer run in the suspect numerics on the *reference's* input, against the
  reference's output (the error this layer makes itself), and the same for each sub-block (norm,
  attention, norm, MLP) on the reference's input to that sub-block;
- **propagated**: the layer run in the reference numerics on the *suspect's* input, against the
  reference's output (the error it only carries on);
- **floor**: what that layer (or sub-block) changes by, in the reference numerics, when its input
  moves by one rounding of the suspect's dtype (each input element times `1 + eps * r`, r seeded
  uniform in [-1, 1], eps the dtype's machine epsilon), plus the rounding of its output to that
  dtype (`eps / 2 * |output|`). Any computation carried out in that dtype makes at least this error.
  Errors are L2 norms over the hidden vector of the deciding row; `ratio = added / floor`, and a
  block *exceeds* its floor when the ratio is above `factor` (default 1).

The first layer (in order) in which a sub-block's added error (or the whole layer's) exceeds its
floor is named, with that sub-block.

Against a batch context (contexts.py: `batched`, `prefix-cache`, `chunked:N`) both runs go through the
engine's real scheduler, the reference alone and the suspect in that context, each with its recorded
tokens forced, and the engine's capture keeps the residual of the row that chose POS after each
layer. A layer cannot be re-run "in a batch" on another input (the batch is the shape of the whole
computation), so added and carried are not separated there: per layer the result gives the total
difference and its **growth** in that layer (`added` = max(0, total - the total before it)),
against the float32 floor of the layer's output, and names the first layer whose growth exceeds it. The result is a table (`BisectResult.describe`), a stored row in
the trace (trace/bisect_store.py) and a figure (notebook/bisect.py). Which numerics an external
engine behaves like is behaves_like.py.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import workbench.engine.layer_walk as lw

FLOOR_SEED = 0


@dataclass(slots=True)
class BlockError:
    """One sub-block's (or the whole layer's) own error against its floor."""

    block: str  # "layer" or a sub-block name (layer_walk.SUB_BLOCKS)
    added: float
    floor: float

    @property
    def ratio(self) -> float:
        return self.added / self.floor if self.floor > 0 else (float("inf") if self.added > 0 else 0.0)


@dataclass(slots=True)
class LayerError:
    layer: int
    added: float  # the layer's own error (suspect layer on the reference's input); a context's: the growth
    propagated: float | None  # reference layer on the suspect's input (None for a context: not separable)
    total: float  # suspect residual vs reference residual after the layer
    floor: float
    norm: float  # |reference residual| after the layer, for scale
    blocks: list[BlockError] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return BlockError("layer", self.added, self.floor).ratio


@dataclass(slots=True)
class Pick:
    """The token each numerics picks at the deciding row, with its log-probability and top-2 margin."""

    token_id: int
    text: str
    logprob: float
    margin: float  # top-1 minus top-2 log-probability


@dataclass(slots=True)
class BisectResult:
    trace: str
    req_id: str
    position: int
    against: str
    reference: str
    factor: float
    recorded_token: int | None
    reference_pick: Pick
    suspect_pick: Pick
    layers: list[LayerError]
    embed_error: float  # |suspect embeddings - reference embeddings| at the row
    seconds: float = 0.0
    note: str = ""
    kind: str = "numerics"  # or "context" (contexts.py): added is the growth of the difference in the layer

    @property
    def first(self) -> tuple[int, str] | None:
        """(layer, sub-block) of the first layer where a sub-block's added error, or the whole
        layer's, exceeds `factor` times its floor (the first such sub-block in the layer's order;
        "layer" when only the whole layer does), or None."""
        for layer in self.layers:
            block = next((b.block for b in layer.blocks if b.ratio > self.factor), None)
            if block is None and layer.ratio > self.factor:
                block = "layer"
            if block is not None:
                return layer.layer, block
        return None

    def to_row(self) -> dict[str, Any]:
        first = self.first
        return {"key": f"{self.req_id}:{self.position}:{self.against}", "req_id": self.req_id,
                "position": self.position, "against": self.against, "reference": self.reference,
                "factor": self.factor, "recorded_token": self.recorded_token,
                "reference_pick": asdict(self.reference_pick), "suspect_pick": asdict(self.suspect_pick),
                "embed_error": self.embed_error, "first_layer": first[0] if first else None,
                "first_block": first[1] if first else None, "note": self.note, "kind": self.kind,
                "layers": [{"layer": x.layer, "added": x.added, "propagated": x.propagated, "total": x.total,
                            "floor": x.floor, "norm": x.norm, "ratio": _finite(x.ratio),
                            "blocks": [{"block": b.block, "added": b.added, "floor": b.floor,
                                        "ratio": _finite(b.ratio)} for b in x.blocks]} for x in self.layers]}

    def describe(self) -> str:
        from workbench.rerun.bisect_format import format_result

        return format_result(self.to_row(), self.seconds)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _pick(logprobs: torch.Tensor, text: Any) -> Pick:
    top = logprobs.topk(2).values
    token = int(logprobs.argmax())  # the first of tied maxima, as the engine's greedy pick
    return Pick(token, text(token), float(top[0]), float(top[0] - top[1]))


def _dist(a: torch.Tensor, b: torch.Tensor, row: int) -> float:
    return float((a[0, row].float() - b[0, row].float()).norm())


def _floor(ref: lw.Numerics, layer: int, block: str, call: lw.Call, eps: float, row: int,
           gen: torch.Generator) -> float:
    """How far `block`'s output moves (reference numerics) when its input moves by one rounding of
    the suspect's dtype, plus the rounding of its output to that dtype."""
    x = lw.hidden_input(call)
    r = torch.rand(x.shape, generator=gen, dtype=torch.float64).mul_(2).sub_(1).to(x.device)
    moved = (x.double() * (1 + eps * r)).to(x.dtype)
    y = lw.rerun(ref, layer, block, lw.with_input(call, moved))
    return _dist(y, call.out, row) + eps / 2 * float(call.out[0, row].norm())


def attribute(ref: lw.Numerics, sus: lw.Numerics, ids: list[int], text: Any = str) -> tuple[
        list[LayerError], Pick, Pick, float]:
    """Per layer, the error it adds and carries at the last row of `ids` (the row that picks the next
    token), each against its floor; with the token each numerics picks there."""
    row = len(ids) - 1
    a = lw.walk(ref, ids, [row])
    b = lw.walk(sus, ids, [row])
    gen = torch.Generator().manual_seed(FLOOR_SEED)
    layers = []
    for i, (rc, sc) in enumerate(zip(a.calls, b.calls, strict=True)):
        ref_out = rc["layer"].out
        added = _dist(lw.rerun(sus, i, "layer", rc["layer"]), ref_out, row)
        carried = _dist(lw.rerun(ref, i, "layer", lw.Call(tuple(lw.cast(sc["layer"].args, ref.dtype)),
                                                         rc["layer"].kwargs, ref_out)), ref_out, row)
        blocks = []
        for name in lw.SUB_BLOCKS:
            if name in rc:
                blocks.append(BlockError(name, _dist(lw.rerun(sus, i, name, rc[name]), rc[name].out, row),
                                         _floor(ref, i, name, rc[name], sus.eps, row, gen)))
        layers.append(LayerError(i, added, carried, float((b.residual[i + 1][row] - a.residual[i + 1][row]).norm()),
                                 _floor(ref, i, "layer", rc["layer"], sus.eps, row, gen),
                                 float(a.residual[i + 1][row].norm()), blocks))
    embed = float((b.residual[0][row] - a.residual[0][row]).norm())
    return layers, _pick(a.logprobs[0], text), _pick(b.logprobs[0], text), embed


def sequence(trace: Any, req_id: str, position: int) -> tuple[list[int], int | None]:
    """The ids before output `position` of `req_id` (prompt, then its tokens) and the token recorded there."""
    from workbench.external.check import recorded_scored

    scored = {s.req_id: s for s in recorded_scored(trace)}
    if req_id not in scored:
        raise ValueError(f"--at: no request {req_id!r} in the trace; requests are {sorted(scored)}")
    s = scored[req_id]
    if not s.tokens:
        raise ValueError(f"--at: request {req_id!r} has no recorded tokens")
    if not 0 <= position < len(s.tokens):
        raise ValueError(f"--at {req_id}:{position}: position must be in [0, {len(s.tokens)}) (its recorded tokens)")
    if not s.prompt_ids:
        raise ValueError(f"--at: request {req_id!r} has no prompt ids to re-run")
    return s.prompt_ids + [t.token_id for t in s.tokens[:position]], s.tokens[position].token_id


def reference_runner(trace: Any, model: str | None, device: str | None) -> tuple[Any, Any]:
    """The reference `ModelRunner` (float32, exact kernels) for the trace's model (or `model`), and a
    loader of the same weights in another dtype."""
    from workbench.models.loader import load_model
    from workbench.rerun.rebuild import model_meta

    meta = model_meta(trace) if trace.meta.get("source") != "external" else {}
    spec = model or meta.get("spec") or "smollm2"
    device = device or "cpu"
    loaded = load_model(spec, device=device, dtype="float32")
    if model is None and meta.get("hash") and loaded.content_hash != meta["hash"]:
        raise ValueError(f"model {spec!r} has content hash {loaded.content_hash}, but the trace was recorded with "
                         f"{meta['hash']}: refusing to bisect against a different model")
    return lw.runner_for(loaded), _cached(lambda dtype: load_model(spec, device=device, dtype=dtype))


def bisect(trace: str, at: str | tuple[str, int], *, against: str | dict[str, torch.nn.Module] = "bfloat16",
           model: str | None = None, device: str | None = None, factor: float = 1.0, runner: Any = None,
           load: Any = None, store: bool = True) -> BisectResult:
    """Attribute the difference between the reference numerics and `against` (a name in
    layer_walk.CANDIDATES, or `{module path: replacement module}` swapped into the reference model)
    at `at` = REQ:POS of `trace`. `runner`: a reference ModelRunner to reuse; `load(dtype)`: how to
    load its weights in another dtype (both from `reference_runner`)."""
    from workbench.rerun.fork import parse_at
    from workbench.trace.reader import open_trace

    if not (isinstance(factor, (int, float)) and factor > 0):
        raise ValueError(f"factor must be a number > 0, got {factor!r}")
    t0 = time.perf_counter()
    rid, position = parse_at(at) if isinstance(at, str) else at
    with open_trace(trace) as t:
        ids, recorded = sequence(t, rid, position)
        if runner is None:
            runner, load = reference_runner(t, model, device)
        elif load is None:
            load = loader_like(runner)
    from workbench.rerun.contexts import is_context

    if isinstance(against, str) and is_context(against):
        result = bisect_context(str(trace), rid, position, against, runner, float(factor))
        result.seconds = time.perf_counter() - t0
        if store:
            from workbench.trace.bisect_store import store_bisect

            store_bisect(trace, result.to_row())
        return result
    ref = lw.numerics_for("float32", runner, load)
    sus = lw.swapped(ref, against) if isinstance(against, dict) else lw.numerics_for(against, runner, load)
    tok = runner.loaded.tokenizer
    layers, rp, sp, embed = attribute(ref, sus, ids, lambda t: tok.decode([t]))
    note = "" if rp.token_id == sp.token_id else f"the suspect picks {sp.text!r} where the reference picks {rp.text!r}"
    result = BisectResult(str(trace), rid, position, sus.name, f"{runner.loaded.spec} float32 exact", float(factor),
                          recorded, rp, sp, layers, embed, time.perf_counter() - t0, note)
    if store:
        from workbench.trace.bisect_store import store_bisect

        store_bisect(trace, result.to_row())
    return result


def bisect_context(trace: str, rid: str, position: int, context: str, runner: Any, factor: float) -> BisectResult:
    """The reference alone vs the reference in `context` (both through the engine's scheduler, tokens
    forced), compared layer by layer at the row that chose `position` (the engine's capture)."""
    from workbench.external.check import recorded_scored
    from workbench.rerun import contexts as cx
    from workbench.trace.reader import open_trace

    ctx = cx.parse_context(context)
    if ctx.kind == "alone":
        raise ValueError("--against alone is the reference itself: give batched, prefix-cache or chunked:N")
    with open_trace(trace) as t:
        ids, recorded = sequence(t, rid, position)
        scored = recorded_scored(t)
    vocab = runner.vocab_size
    reqs = [cx.Request(s.req_id, list(s.prompt_ids), [x.token_id for x in s.tokens]) for s in scored
            if s.tokens and s.prompt_ids and all(0 <= i < vocab for i in s.prompt_ids + [x.token_id for x in s.tokens])]
    target = next((r for r in reqs if r.req_id == rid), None)
    if target is None:
        raise ValueError(f"--at {rid}:{position}: its token ids are outside the reference's vocabulary [0, {vocab})")
    others = [r for r in reqs if r.req_id != rid]
    if ctx.kind == "batched" and not others:
        raise ValueError(f"--against batched: the trace has no other request to batch {rid!r} with")
    tok = runner.loaded.tokenizer
    runs = [cx.run_context(runner.loaded, name, reqs, rid, position, [], capture_at=position)
            for name in ("alone", ctx.name)]
    if any(r.residual is None for r in runs):
        raise ValueError(f"--against {context}: the engine captured no residual at {rid}:{position}")
    a, b = (torch.from_numpy(r.residual) for r in runs)  # [layers + 1, hidden]
    eps = lw.EPS[torch.float32]
    layers, before = [], float((b[0] - a[0]).norm())
    for i in range(a.shape[0] - 1):
        total = float((b[i + 1] - a[i + 1]).norm())
        norm = float(a[i + 1].norm())
        layers.append(LayerError(i, max(0.0, total - before), None, total, eps / 2 * norm, norm))
        before = total
    picks = []
    for r in runs:
        top = r.top.get(position) or [(recorded or 0, 0.0)]
        margin = top[0][1] - top[1][1] if len(top) > 1 else 0.0
        picks.append(Pick(top[0][0], tok.decode([top[0][0]]), top[0][1], margin))
    note = "; ".join(x for x in (runs[1].note, "" if picks[0].token_id == picks[1].token_id else
                                 f"the suspect picks {picks[1].text!r} where the reference picks {picks[0].text!r}") if x)
    return BisectResult(trace, rid, position, ctx.name, f"{runner.loaded.spec} float32 exact, alone", factor, recorded,
                        picks[0], picks[1], layers, float((b[0] - a[0]).norm()), note=note, kind="context")


def loader_like(runner: Any) -> Any:
    from workbench.models.loader import load_model

    spec, device = runner.loaded.spec, runner.loaded.device
    return _cached(lambda dtype: load_model(spec, device=device, dtype=dtype))


def _cached(load: Any) -> Any:
    """`load(dtype)`, each dtype loaded once (auto mode fits every candidate, then bisects the winner)."""
    return functools.cache(load)
