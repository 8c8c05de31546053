"""Drafters: what proposes the tokens the target verifies. One interface, three kinds.

Owns: `NgramDrafter` (prompt lookup, no model), `DraftModelDrafter` (a separate model sharing the
target's tokenizer, with its own ModelRunner and KV Memory) and `EarlyExitDrafter` (the target's
first N layers with its final norm and head), each proposing up to `k` tokens per request with the
drafter's probability q of each, plus their KV bookkeeping. Does not own: verification
(verify.py), the target's KV or tracing (the worker reports the `forwards` a drafter ran).

KV of the model drafters. The draft model keeps its own pool, sized like the target's; it catches
up with the tokens the target committed in the first forward of each round (`DRAFT_EXTEND`: every
fill token it has not seen, then the first draft) and prefills alongside the target's prefill
chunks (`on_extend`); after verification the slots of its rejected drafts are freed. The early-exit
drafter needs no pool of its own: layer i's K/V at a position depend only on the tokens up to it
and on layers below i, so the target's K/V for the committed prefix are exactly what the first N
layers would compute. It reads them through the request's own `req_to_token` row, writes its draft
tokens' first-N-layer K/V to scratch slots of the target pool and frees them before verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workbench.engine.run.forward_batch import ForwardBatch, ForwardMode, RowSpec, build_forward_batch
from workbench.engine.run.model_runner import ModelRunner
from workbench.engine.sample.sampler import SamplingBatchInfo
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.request import Req
from workbench.engine.speculative.config import SpecConfig, Target

if TYPE_CHECKING:
    from workbench.engine.sched.batch import ScheduleBatch


@dataclass(slots=True)
class Draft:
    """One request's proposal: tokens, the drafter's probability of each, its full distributions."""

    tokens: list[int]
    q: list[float]
    q_dist: torch.Tensor | None = None  # [len(tokens), V]; None for a deterministic proposal (q one-hot)


@dataclass(slots=True)
class DraftForward:
    """A forward a drafter ran, kept for the worker to trace."""

    fb: ForwardBatch
    seconds: float


class _DrafterHooks:
    """Default lifecycle hooks of a drafter: nothing to prefill, catch up or free. Drafters with
    state of their own (a KV pool, per-request slots) override them."""

    def on_extend(self, batch: ScheduleBatch) -> None:
        pass

    def after_verify(self, req: Req) -> list[int]:
        return []

    def release(self, req: Req) -> None:
        pass


class NgramDrafter(_DrafterHooks):
    """Prompt lookup: find the longest suffix (max..min tokens) earlier in the context, earliest
    occurrence first, and propose the tokens that followed it."""

    def __init__(self, cfg: SpecConfig) -> None:
        self.name = cfg.describe()
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.forwards: list[DraftForward] = []

    def limit(self, reqs: list[Req], ks: list[int]) -> list[int]:
        return ks

    def propose(self, reqs: list[Req], ks: list[int]) -> list[Draft]:
        out = []
        for req, k in zip(reqs, ks):
            tokens = lookup(req.fill_ids, self.min_n, self.max_n, k) if k > 0 else []
            out.append(Draft(tokens, [1.0] * len(tokens)))
        return out



def lookup(ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the longest suffix of `ids`
    of `max_n` down to `min_n` tokens; [] when no suffix occurs earlier."""
    total = len(ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = ids[total - n:]
        first = suffix[0]
        for start in range(0, total - n):  # an occurrence ending before the suffix starts to overlap the end
            if ids[start] == first and ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


MAX_TOKEN_ROWS = 16  # catch-ups longer than this run as one extend row


def token_rows(req_id: str, pool_idx: int, prefix: int, ids: list[int], sample_rows: int) -> list[RowSpec]:
    """`ids` after `prefix` cached tokens as one one-token row per position (prefix growing by one).

    The attention function writes every new token's K/V before attending, so position j reading
    `prefix + j + 1` slots through `req_to_token` sees exactly what an extend row would show it;
    packed this way a verify batch takes the batched decode attention path instead of one call per
    request and layer. Needs `prefix > 0` (a decode row has a cached prefix)."""
    n = len(ids)
    return [RowSpec(req_id, pool_idx, prefix + j, [tok], int(j >= n - sample_rows)) for j, tok in enumerate(ids)]


class _ModelDrafter(_DrafterHooks):
    """Shared drafting loop of the model drafters: one DRAFT_EXTEND forward (catch-up + first
    draft), then one DECODE forward per further draft token, sampling each from the drafter's
    distribution after the request's own sampling stages (argmax for greedy requests)."""

    layer_limit: int | None = None

    def __init__(self, name: str, target: Target, runner: ModelRunner, memory: Memory) -> None:
        self.name = name
        self.target = target
        self.runner = runner
        self.memory = memory
        self.forwards: list[DraftForward] = []

    # --- KV bookkeeping the two kinds differ in --------------------------------------------

    def _pool_idx(self, req: Req) -> int:
        raise NotImplementedError

    def _kv_len(self, req: Req) -> int:
        raise NotImplementedError

    def _advance(self, req: Req, n: int) -> None:
        raise NotImplementedError

    def _end_round(self) -> None:
        pass

    # --- drafting ------------------------------------------------------------------------

    def propose(self, reqs: list[Req], ks: list[int]) -> list[Draft]:
        self.forwards = []
        drafts = [Draft([], []) for _ in reqs]
        dists: dict[int, list[torch.Tensor]] = {i: [] for i, k in enumerate(ks) if k > 0}
        live = list(dists)
        mode = ForwardMode.DRAFT_EXTEND
        while live:
            live, rows, fed = self._rows(reqs, drafts, live)
            logits = self._forward(mode, rows)  # one row per live request, in (reordered) `live` order
            for i, n in zip(live, fed):
                self._advance(reqs[i], n)
            tokens, q_tok, q_dist = self._sample(logits, [reqs[i] for i in live], [drafts[i].tokens for i in live])
            for j, i in enumerate(live):
                drafts[i].tokens.append(tokens[j])
                drafts[i].q.append(q_tok[j])
                dists[i].append(q_dist[j])
            live = [i for i in live if len(drafts[i].tokens) < ks[i]]
            mode = ForwardMode.DECODE
        self._end_round()
        for i, rows in dists.items():
            drafts[i].q_dist = torch.stack(rows)
        return drafts

    def _rows(self, reqs: list[Req], drafts: list[Draft], live: list[int]
              ) -> tuple[list[int], list[RowSpec], list[int]]:
        """This forward's rows: each live request's unseen fill tokens (the catch-up) or its last
        draft, sampling the last position. Long catch-ups (or ones without a cached prefix) go
        first as extend rows, the rest as one-token rows so the batch attends together. Returns the
        live indices in logits order, the rows, and how many tokens each request feeds."""
        extend, single = [], []
        for i in live:
            req, kv = reqs[i], self._kv_len(reqs[i])
            ids = drafts[i].tokens[-1:] if drafts[i].tokens else req.fill_ids[kv:]
            if kv == 0 or len(ids) > MAX_TOKEN_ROWS:
                extend.append((i, [RowSpec(req.req_id, self._pool_idx(req), kv, ids, 1)], len(ids)))
            else:
                single.append((i, token_rows(req.req_id, self._pool_idx(req), kv, ids, 1), len(ids)))
        ordered = extend + single
        return [i for i, _, _ in ordered], [r for _, rs, _ in ordered for r in rs], [n for _, _, n in ordered]

    def _forward(self, mode: ForwardMode, rows: list[RowSpec]) -> torch.Tensor:
        t0 = time.perf_counter()
        fb = build_forward_batch(mode, rows, self.memory, self.target.device)
        fb.layer_limit = self.layer_limit
        logits = self.runner.forward(fb)
        self.forwards.append(DraftForward(fb, time.perf_counter() - t0))
        return _fit_vocab(logits, self.target.vocab_size)

    def _sample(self, logits: torch.Tensor, reqs: list[Req], prefixes: list[list[int]]
                ) -> tuple[list[int], list[float], torch.Tensor]:
        """Draw each row's draft token from the drafter's distribution after the request's own
        sampling stages (the drafts so far as prefixes); greedy requests take the argmax."""
        t = self.target
        info = SamplingBatchInfo.build(reqs, t.vocab_size, t.device, eos_token_ids=t.eos_token_ids, prefixes=prefixes)
        probs = torch.softmax(t.sampler.process(logits, info), dim=-1)  # [B, V]
        ids, _ = t.sampler.draw(probs, info)
        q_tok = probs.gather(1, ids.view(-1, 1).to(probs.device))[:, 0]
        return ids.tolist(), q_tok.tolist(), probs

    def limit(self, reqs: list[Req], ks: list[int]) -> list[int]:
        return ks



def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafters with a padded or shorter embedding: cut or pad (-inf) their logits to the target's vocab."""
    if logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] > vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class EarlyExitDrafter(_ModelDrafter):
    """The target's first `exit_layer` layers + final norm + head, reading the target's own KV."""

    def __init__(self, cfg: SpecConfig, target: Target) -> None:
        layers = target.runner.num_layers
        exit_layer = cfg.exit_layer if cfg.exit_layer is not None else max(1, layers // 2)
        if not 1 <= exit_layer < layers:
            raise ValueError(f"exit_layer must be in [1, {layers - 1}] for a {layers}-layer model, got {exit_layer}")
        super().__init__(f"early-exit({exit_layer}/{layers})", target, target.runner, target.memory)
        self.layer_limit = exit_layer
        self._scratch: dict[str, int] = {}  # req_id -> draft tokens written past req.kv_len this round
        self._slots: list[torch.Tensor] = []

    def _pool_idx(self, req: Req) -> int:
        return req.req_pool_idx

    def _kv_len(self, req: Req) -> int:
        return req.kv_len + self._scratch.get(req.req_id, 0)

    def _advance(self, req: Req, n: int) -> None:
        self._scratch[req.req_id] = self._scratch.get(req.req_id, 0) + n

    def _forward(self, mode: ForwardMode, rows: list[RowSpec]) -> torch.Tensor:
        logits = super()._forward(mode, rows)
        self._slots.append(self.forwards[-1].fb.out_cache_loc.cpu())
        return logits

    def _end_round(self) -> None:
        """Free the scratch slots: the target's verify rewrites every layer at fresh slots."""
        if self._slots:
            self.memory.allocator.free(torch.cat(self._slots))
        self._slots, self._scratch = [], {}


class DraftModelDrafter(_ModelDrafter):
    """A separate model sharing the target's tokenizer, with its own runner and KV pool."""

    def __init__(self, cfg: SpecConfig, target: Target) -> None:
        from workbench.models.loader import load_model

        loaded = load_model(cfg.draft_model, device=target.device, dtype=target.dtype)
        if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft_model {cfg.draft_model!r} does not share the target's tokenizer "
                             f"(vocabularies differ: {len(loaded.tokenizer)} vs {len(target.tokenizer)} tokens)")
        runner = ModelRunner(loaded)
        pools = target.memory
        self.max_context_len = min(runner.max_context_len, target.runner.max_context_len)
        memory = Memory(num_layers=runner.num_layers, kv_heads=runner.kv_heads, head_dim=runner.head_dim,
                        kv_tokens=pools.allocator.size, max_running=pools.req_to_token_pool.size,
                        max_context_len=self.max_context_len, dtype=runner.dtype, device=target.device,
                        slot_order=pools.allocator.order)  # the target's order: a replay hands out the same slots
        super().__init__(cfg.describe(), target, runner, memory)
        self.loaded = loaded
        self.seqs: dict[str, list[int]] = {}  # req_id -> [draft pool slot, draft kv_len]

    def _seq(self, req: Req) -> list[int]:
        seq = self.seqs.get(req.req_id)
        if seq is None:
            seq = self.seqs[req.req_id] = [self.memory.req_to_token_pool.allocate(), 0]
        return seq

    def _pool_idx(self, req: Req) -> int:
        return self._seq(req)[0]

    def _kv_len(self, req: Req) -> int:
        return self._seq(req)[1]

    def _advance(self, req: Req, n: int) -> None:
        self.seqs[req.req_id][1] += n

    def limit(self, reqs: list[Req], ks: list[int]) -> list[int]:
        """Fit each request's drafting in the draft pool and context: catch-up + k - 1 new slots."""
        free = self.memory.allocator.available_size()
        out = []
        for req, k in zip(reqs, ks):
            seq = self.seqs.get(req.req_id)
            if seq is None and not self.memory.req_to_token_pool.can_allocate():
                out.append(0)
                continue
            catch_up = req.seq_len - (seq[1] if seq else 0)
            k = max(0, min(k, self.max_context_len - req.seq_len, free - catch_up + 1))
            free -= catch_up + k - 1 if k else 0
            out.append(k)
        return out

    def on_extend(self, batch: ScheduleBatch) -> None:
        """Prefill the draft with the target's prefill chunks (skipped when the draft pool is full:
        the next round's DRAFT_EXTEND then catches up)."""
        self.forwards = []
        rows = []
        for chunk in batch.prefill:
            req = chunk.req
            if req.req_id not in self.seqs and not self.memory.req_to_token_pool.can_allocate():
                continue
            kv = self._kv_len(req)
            end = min(chunk.start + chunk.length, self.max_context_len)
            if end > kv:
                rows.append(RowSpec(req.req_id, self._pool_idx(req), kv, req.fill_ids[kv:end], 0))
        if not rows or not self.memory.allocator.can_allocate(sum(len(r.input_ids) for r in rows)):
            return
        self._forward(ForwardMode.EXTEND, rows)
        for row in rows:
            self.seqs[row.req_id][1] += len(row.input_ids)

    def after_verify(self, req: Req) -> list[int]:
        """Free the draft's KV past what the target kept (its rejected drafts); return those slots."""
        seq = self.seqs.get(req.req_id)
        if seq is None or seq[1] <= req.kv_len:
            return []
        slots = self.memory.req_to_token_pool.req_to_token[seq[0], req.kv_len:seq[1]].cpu()
        self.memory.allocator.free(slots)
        seq[1] = req.kv_len
        return slots.tolist()

    def release(self, req: Req) -> None:
        seq = self.seqs.pop(req.req_id, None)
        if seq is None:
            return
        self.memory.allocator.free(self.memory.req_to_token_pool.req_to_token[seq[0], :seq[1]].cpu())
        self.memory.req_to_token_pool.free(seq[0])


Drafter = NgramDrafter | EarlyExitDrafter | DraftModelDrafter


def make_drafter(cfg: SpecConfig, target: Target) -> Drafter:
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "early-exit":
        return EarlyExitDrafter(cfg, target)
    return DraftModelDrafter(cfg, target)
