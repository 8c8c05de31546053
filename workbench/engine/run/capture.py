"""Capture inside the forward pass of the unmodified model, for chosen requests while serving.

Owns: which rows of a ForwardBatch are captured (`Capturer.plan`: the sampling rows of captured
requests, None when there are none, which is the one check a step pays when capture is off),
the forward hooks that read the residual stream of those rows (a pre-hook on the first decoder
layer for the embeddings, a hook on each layer for its output; registered for that forward only),
the attention weights of those rows, computed from the attention function's own query and the
keys it has just written to the KV pool with the layer's scaling, window, soft-cap and sinks
(`ForwardCapture.attention`, called by attention.py), and after sampling the logit lens (each
residual through the model's final norm and `lm_head`) and the `CaptureRecord`s the trace
observer stores. Does not own: the spec (capture_spec.py) or storage (tracing.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.engine.run.attention import attention_probs
from workbench.engine.run.capture_spec import CaptureSpec


@dataclass(slots=True)
class CaptureRow:
    """One captured sampling row: its token index in the packed batch and its request's KV."""

    batch_row: int  # index into the sampled rows (logits_owner)
    token: int  # token index in the packed forward
    req_id: str
    spec: CaptureSpec
    pool_idx: int
    kv_len: int  # positions the row attends (its own included)
    prompt_ids: list[int] | None = None  # on the request's first captured row: its prompt, for the texts


@dataclass(slots=True)
class CaptureRecord:
    """What one captured output position keeps (numpy-ready CPU tensors, stored by tracing.py)."""

    req_id: str
    position: int
    token_id: int
    kv_len: int
    margin: float
    what: list[str]
    tensors: dict[str, torch.Tensor]
    lens_ids: list[list[int]] = field(default_factory=list)
    prompt_ids: list[int] | None = None


class ForwardCapture:
    """The captured rows of one forward and what the hooks and the attention function read of them."""

    def __init__(self, rows: list[CaptureRow], model: torch.nn.Module, started: set[str]) -> None:
        self.rows = rows
        self.started = started  # the capturer's: requests whose prompt texts are stored
        self.model = model
        self.tokens = torch.tensor([r.token for r in rows], dtype=torch.int64)
        self.residual: list[torch.Tensor] = []  # per entry (embeddings, then each layer): [R, hidden]
        self.attn: dict[int, list[torch.Tensor]] = {}  # layer -> per row [heads, kv_len]
        self.want_attention = any("attention" in r.spec.what for r in rows)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        layers = self.model.model.layers
        idx = self.tokens.to(next(self.model.parameters()).device)

        def take(hidden: Any) -> None:
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            self.residual.append(hidden[0].index_select(0, idx).float().cpu())  # [R, hidden]

        def pre(module, args, kwargs):
            take(args[0] if args else kwargs["hidden_states"])

        handles = [layers[0].register_forward_pre_hook(pre, with_kwargs=True)]
        handles += [layer.register_forward_hook(lambda m, a, out: take(out)) for layer in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def attention(self, layer: int, query: torch.Tensor, kv: Any, table: torch.Tensor, scale: float,
                  window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> None:
        """Each captured row's attention weights `[heads, kv_len]` at `layer`, as transformers' eager
        attention computes them: scores over the row's KV slots (already written), soft-cap, window,
        softmax with the sink logit joining and then dropped."""
        if not self.want_attention:
            return
        out = self.attn.setdefault(layer, [])
        for row in self.rows:
            q = query[0, :, row.token].float()[None, :, None]  # [1, H, 1, D]
            slots = table[row.pool_idx, :row.kv_len].to(kv.k[layer].device)
            k = kv.k[layer].index_select(0, slots).float().transpose(0, 1)[None]  # [1, KVH, L, D]
            mask = None
            if window is not None and row.kv_len > window:  # the query sees the last `window` positions
                mask = torch.arange(row.kv_len, device=k.device) >= row.kv_len - window
            out.append(attention_probs(q, k, mask, scale, softcap, sinks)[0, :, 0].cpu())  # [H, L]

    def finish(self, logits: torch.Tensor, chosen: list[int], reqs: list[Any]) -> list[CaptureRecord]:
        """The records of the rows to keep: `logits [sampled rows, vocab]` (what the sampler saw),
        the chosen token and the request of every sampled row (before the token is appended)."""
        positions = [len(r.output_ids) for r in reqs]
        records = []
        if not self.residual:
            return records
        residual = torch.stack(self.residual, dim=1)  # [R, layers + 1, hidden]
        for i, row in enumerate(self.rows):
            spec, b = row.spec, row.batch_row
            probs = torch.softmax(logits[b].float(), dim=-1)
            top2 = probs.topk(2).values
            margin = float(top2[0] - top2[1])
            if not spec.wants(positions[b]) or (spec.margin is not None and margin >= spec.margin):
                continue
            rec = CaptureRecord(row.req_id, positions[b], int(chosen[b]), row.kv_len, margin, list(spec.what), {},
                                prompt_ids=row.prompt_ids if row.req_id not in self.started else None)
            self.started.add(row.req_id)
            res = residual[i]
            if "hidden" in spec.what:
                rec.tensors["hidden"] = res
            if "norms" in spec.what:
                rec.tensors["norms"] = res.norm(dim=-1)
            if "lens" in spec.what:
                self._lens(rec, res, spec.lens_topk)
            if "attention" in spec.what and self.attn:
                self._attention(rec, i, spec)
            records.append(rec)
        return records

    @torch.inference_mode()
    def _lens(self, rec: CaptureRecord, residual: torch.Tensor, k: int) -> None:
        """Each entry of the residual stream through the final norm and lm_head (and the final soft-cap)."""
        model = self.model
        weight = next(model.lm_head.parameters())
        logits = model.lm_head(model.model.norm(residual.to(weight.device, weight.dtype))).float()  # [E, vocab]
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logp = torch.log_softmax(logits, dim=-1).cpu()
        vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        picked = logp[:, rec.token_id]
        rec.tensors["lens_ids"] = ids.to(torch.int32)  # vocabularies fit; half the bytes of int64
        rec.tensors["lens_logprobs"] = vals
        rec.tensors["lens_chosen_logprob"] = picked
        rec.tensors["lens_chosen_rank"] = ((logp > picked[:, None]).sum(dim=-1) + 1).to(torch.int32)
        rec.lens_ids = ids.tolist()

    def _attention(self, rec: CaptureRecord, i: int, spec: CaptureSpec) -> None:
        w = torch.stack([self.attn[layer][i] for layer in sorted(self.attn)])  # [layers, heads, kv_len]
        ent = -torch.special.xlogy(w, w).sum(-1)
        rec.tensors["attention_entropy"] = ent
        if spec.attention_whole:
            rec.tensors["attention"] = w
        else:
            vals, pos = w.topk(min(spec.attention_topk, w.shape[-1]), dim=-1)
            rec.tensors["attention_positions"] = pos.to(torch.int32)
            rec.tensors["attention_weights"] = vals


class Capturer:
    """The engine's capture setting and the requests it covers; plans each forward's capture."""

    def __init__(self, model: torch.nn.Module, spec: Any, speculative: bool, tracer: Any) -> None:
        self.model = model
        self.spec = CaptureSpec.parse(spec)
        self.speculative = speculative
        self.tracer = tracer  # capture is stored in the trace: it needs tracing on
        self.by_req: dict[str, CaptureSpec] = {}
        self.started: set[str] = set()  # requests whose prompt texts the trace already has
        if self.spec is not None:
            self._check_can_capture("capture")

    def _check_can_capture(self, name: str) -> None:
        if self.speculative:
            raise ValueError(f"{name}: capture inside the forward is not supported with speculative decoding")
        if not self.tracer.on:
            raise ValueError(f"{name}: capture is stored in the trace; trace_level must be 'summary' or 'full'")
        if not hasattr(self.model, "lm_head") or not hasattr(getattr(self.model, "model", None), "layers"):
            raise ValueError(f"{name}: the model has no model.layers / lm_head to capture")

    def admit(self, req_ids: list[str], capture: Any) -> None:
        """Register the requests `add_request` is about to queue (ValueError before any is queued)."""
        spec = CaptureSpec.parse(capture, "capture")
        if spec is not None:
            self._check_can_capture("capture")
        for rid in req_ids:
            chosen = spec or (self.spec if self.spec is not None and self.spec.covers(rid) else None)
            if chosen is not None:
                self.by_req[rid] = chosen

    def forget(self, req_id: str) -> None:
        self.by_req.pop(req_id, None)
        self.started.discard(req_id)

    def plan(self, fb: Any, reqs: list[Any]) -> ForwardCapture | None:
        """The captured rows of `fb` (the sampling rows of captured requests), or None."""
        if not self.by_req:
            return None
        rows = []
        keep = fb.logits_rows.tolist()
        for b, owner in enumerate(fb.logits_owner):
            spec = self.by_req.get(fb.req_ids[owner])
            rid = fb.req_ids[owner]
            if spec is not None and spec.wants(len(reqs[owner].output_ids)):
                first = rid not in self.started
                rows.append(CaptureRow(b, keep[b], rid, spec, int(fb.req_pool_indices[owner]),
                                       int(fb.seq_lens[owner]), list(reqs[owner].prompt_ids) if first else None))
        return ForwardCapture(rows, self.model, self.started) if rows else None
