"""Engine core behaviour a user notices: abort, refusal, memory accounting, modes, streaming."""

from __future__ import annotations

import contextlib

import pytest
import torch

from workbench.engine.engine import Engine, StepFailed
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.memory import KVPool, TokenToKVPoolAllocator

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Roses are red,",
           "The quick brown fox", "In 1969, the first"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def test_allocator_pairs_and_reserved_slot():
    alloc = TokenToKVPoolAllocator(8, "cpu")
    assert alloc.can_allocate(8) and not alloc.can_allocate(9)
    got = alloc.allocate(8)
    assert sorted(got.tolist()) == list(range(1, 9)), "slot 0 is padding and never handed out"
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    alloc.free(got[:3])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(got[:1])
    alloc.free(got[3:])
    assert alloc.available_size() == 8


@pytest.mark.parametrize("order", ["restart", "fifo"])
def test_freed_slots_go_to_the_back_and_restart_from_slot_1_once_all_are_free(order):
    alloc = TokenToKVPoolAllocator(8, "cpu", order)
    a, b = alloc.allocate(3), alloc.allocate(2)
    alloc.free(b)  # a still holds slots: in both orders the freed ones queue at the back
    c = alloc.allocate(4)
    assert c.tolist() == [6, 7, 8, 4]
    alloc.free(a)
    alloc.free(c)
    # everything is free: "restart" hands out the pages an idle server has touched, from slot 1
    # again; "fifo" goes on through the queue (the order of traces from before "restart")
    assert alloc.available_size() == 8
    assert alloc.allocate(4).tolist() == ([1, 2, 3, 4] if order == "restart" else [5, 1, 2, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_write_stores_what_index_copy_stores_and_refuses_a_slot_outside_the_pool(dtype):
    # The write copies rows in C where the sources are contiguous; the attention passes views of
    # the rotated keys, a transposed source takes index_copy_, and either way the pool holds the
    # same bytes. A slot past the end is index_copy_'s IndexError.
    pool, want = KVPool(2, 40, 3, 8, dtype, "cpu"), KVPool(2, 40, 3, 8, dtype, "cpu")
    for t in (*pool.k, *pool.v, *want.k, *want.v):
        t[1:].fill_(float("nan"))
    rotated = torch.randn(1, 5, 24).to(dtype).view(1, 5, 3, 8).transpose(1, 2)  # [1, KVH, T, D], as attention gets it
    sources = [(rotated[0].transpose(0, 1), torch.randn(5, 3, 8).to(dtype)),
               (torch.randn(5, 8, 3).to(dtype).transpose(1, 2), torch.randn(5, 3, 8).to(dtype))]  # not contiguous
    for layer, (k, v) in enumerate(sources):
        loc = torch.tensor([7, 40, 2, 19, 33])
        pool.write(layer, loc, k, v)
        want.k[layer].index_copy_(0, loc, k)
        want.v[layer].index_copy_(0, loc, v)
    for got, exp in zip((*pool.k, *pool.v), (*want.k, *want.v), strict=True):
        assert torch.equal(got.float().nan_to_num(9.0), exp.float().nan_to_num(9.0))
    with pytest.raises(IndexError, match="out of bounds"):
        pool.write(0, torch.tensor([3, 41]), torch.randn(2, 3, 8).to(dtype), torch.randn(2, 3, 8).to(dtype))


@pytest.mark.parametrize("slots", [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 12], [5, 7, 6, 8, 9, 10]],
                         ids=["consecutive", "last-apart", "two-swapped"])
def test_a_lone_decode_rows_attention_plan_is_its_row_of_the_batch_plan(slots):
    """Batch 1 builds its decode plan by a shorter path: the same KV slots, mask and length as the
    row's part of a two-row plan, the same slot written to req_to_token, and the pool read in place
    only where its slots are consecutive (a wrong answer there reads another request's KV)."""
    from workbench.engine.run.forward_batch import RowSpec, _decode_plan

    n = len(slots)
    lone, pair = torch.zeros((2, 16), dtype=torch.int64), torch.zeros((2, 16), dtype=torch.int64)
    for table in (lone, pair):
        table[0, :n - 1] = torch.tensor(slots[:-1])
        table[1, :3] = torch.tensor([30, 31, 32])
    row, other = RowSpec("a", 0, n - 1, [1], 1), RowSpec("b", 1, 3, [1], 1)
    one = _decode_plan([row], [n], lone, 0, [], torch.tensor(slots[-1:]))
    two = _decode_plan([row, other], [n, 4], pair, 0, [], torch.tensor([slots[-1], 33]))
    assert torch.equal(lone[0], pair[0]) and lone[0, n - 1] == slots[-1]
    assert torch.equal(one.decode_kv_idx, two.decode_kv_idx[:1, :n]) and one.decode_kv_idx.tolist() == [slots]
    assert torch.equal(one.decode_mask, two.decode_mask[:1, ..., :n]) and bool(one.decode_mask.all())
    assert torch.equal(one.decode_lens, two.decode_lens[:1])
    assert one.decode_run == (slots[0] if slots == list(range(slots[0], slots[0] + n)) else None)
    lone[0, 0] = 99  # the plan holds its own copy: a later write to req_to_token does not reach it
    assert one.decode_kv_idx[0, 0] == slots[0]


def test_a_bad_kv_slot_order_names_the_parameter_and_the_choices(tiny):
    with pytest.raises(ValueError, match="kv_slot_order must be one of restart, fifo, got 'lifo'"):
        Engine(tiny, trace_level="off", kv_slot_order="lifo")


def test_abort_mid_run_leaves_others_unchanged(tiny):
    baseline = Engine(tiny, trace_level="off").generate(PROMPTS, GREEDY)
    engine = Engine(tiny, trace_level="off")
    ids = [engine.add_request(p, GREEDY)[0] for p in PROMPTS]
    for _ in range(6):
        engine.step()
    engine.abort(ids[2])
    engine.abort(ids[2])  # idempotent
    while engine.has_work():
        engine.step()
    outs = [engine.finished[i] for i in ids]
    assert outs[2].finish_reason == "abort" and 0 < len(outs[2].token_ids) < GREEDY.max_new_tokens
    for i, (a, b) in enumerate(zip(baseline, outs)):
        if i != 2:
            assert a.token_ids == b.token_ids
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size
    assert engine.memory.req_to_token_pool.available_size() == engine.memory.req_to_token_pool.size


def test_abort_waiting_request(tiny):
    engine = Engine(tiny, trace_level="off", max_running=1)
    a = engine.add_request("hello there", GREEDY)[0]
    b = engine.add_request("general kenobi", GREEDY)[0]
    engine.step()
    engine.abort(b)
    while engine.has_work():
        engine.step()
    assert engine.finished[b].finish_reason == "abort" and engine.finished[b].token_ids == []
    assert engine.finished[a].finish_reason == "length"


def _run_to_end(engine, prompts, params, max_steps):
    ids = [engine.add_request(p, params)[0] for p in prompts]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps <= max_steps, f"no request finished after {steps} steps: the scheduler is livelocked"
    return [engine.finished[i] for i in ids], steps


@pytest.mark.parametrize("chunk_size", [8, 128])
def test_small_pool_finishes_without_thrashing(tiny, chunk_size):
    # Two prompts that each take more than half the pool plus short ones, all arriving in one step:
    # partly prefilled requests can hold the whole pool with nothing decoding, and equal arrival
    # steps once made the scheduler preempt the oldest request forever.
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    prompts = [list(range(10, 130)), list(range(200, 330))] + [list(range(400 + i, 420 + i)) for i in range(6)]
    want = Engine(tiny, trace_level="off").generate(prompts, params)
    engine = Engine(tiny, trace_level="off", kv_tokens=200, chunk_size=chunk_size, max_batch_tokens=256)
    outs, steps = _run_to_end(engine, prompts, params, max_steps=1000)
    assert sum(o.timings["preemptions"] for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size


@pytest.mark.parametrize("spec", [None, "ngram:k=2"])
def test_a_failing_step_ends_its_requests_frees_their_kv_and_the_engine_goes_on(tiny, spec):
    engine = Engine(tiny, trace_level="summary", spec=spec)
    forward, calls = engine.runner.forward, []

    def flaky(fb):
        calls.append(fb.forward_mode)
        if len(calls) == 3:  # the prefill and one decode succeed, then a step fails mid-forward
            raise RuntimeError("injected failure")
        return forward(fb)

    engine.runner.forward = flaky
    ids = [engine.add_request(p, GREEDY)[0] for p in PROMPTS[:3]]
    with pytest.raises(StepFailed, match="failed in step 3 .RuntimeError.") as failure:
        while engine.has_work():
            engine.step()
    assert sorted(failure.value.affected) == sorted(ids)
    for rid in ids:
        out = engine.finished[rid]
        assert out.finish_reason == "abort" and "RuntimeError" in out.error
        assert len(out.token_ids) == 2 if spec is None else len(out.token_ids) >= 2  # a verify may accept more
    # the slots the failed step had allocated for its new tokens came back too
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size
    assert engine.memory.req_to_token_pool.available_size() == engine.memory.req_to_token_pool.size
    errors = [e for e in engine.memory_sink.events if e.kind == "error"]
    assert len(errors) == 1 and sorted(errors[0].affected) == sorted(ids)
    again = engine.generate(PROMPTS[0], GREEDY)[0]
    assert again.token_ids == Engine(tiny, trace_level="off").generate(PROMPTS[0], GREEDY)[0].token_ids


def test_request_that_can_never_fit_is_refused(tiny):
    engine = Engine(tiny, trace_level="off", kv_tokens=64)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request("hello " * 10, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(list(range(5, 3000)), SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    # the engine still serves a request that fits
    assert engine.generate("hello", SamplingParams(temperature=0, max_new_tokens=4))[0].finish_reason


def test_mixed_batches_and_chunked_prefill_are_traced(tiny):
    engine = Engine(tiny, trace_level="summary", chunk_size=8, max_batch_tokens=16)
    first = engine.add_request("a b c d e f", GREEDY)[0]
    for _ in range(3):
        engine.step()
    engine.add_request("one two three four five six seven eight nine ten eleven twelve", GREEDY)
    while engine.has_work():
        engine.step()
    sink = engine.memory_sink
    modes = [e.mode for e in sink.of_kind("schedule")]
    assert "MIXED" in modes and "EXTEND" in modes and "DECODE" in modes
    chunks = [c for e in sink.of_kind("schedule") for c in e.prefill if c["req_id"] != first]
    assert len(chunks) >= 2 and all(c["length"] <= 8 for c in chunks)
    fbs = sink.of_kind("forward_batch")
    assert all(len(e.input_ids) == len(e.positions) == len(e.out_cache_loc) for e in fbs)
    assert all(0 not in e.out_cache_loc for e in fbs)
    tokens = sink.of_kind("token")
    assert len(tokens) == 2 * GREEDY.max_new_tokens and all(t.logprob <= 0 for t in tokens)


def test_stream_deltas_concatenate_to_text(tiny):
    engine = Engine(tiny, trace_level="off")
    deltas, final = [], None
    for out in engine.stream("The quick brown fox", SamplingParams(temperature=0, max_new_tokens=20)):
        deltas.append(out.delta)
        final = out.output
    assert final is not None and "".join(deltas) == final.text


def test_seeded_request_is_reproducible(tiny):
    params = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=16)
    a = Engine(tiny, trace_level="off").generate("Tell me", params)[0]
    b = Engine(tiny, trace_level="off").generate(["Tell me", "other prompt"], [params, params.replace(seed=9)])[0]
    assert a.token_ids == b.token_ids


def test_tracing_off_creates_no_sink(tiny):
    engine = Engine(tiny, trace_level="off")
    assert not engine.tracer.on and engine.memory_sink is None


@pytest.mark.gpu
def test_cuda_bf16_greedy_runs(smollm2):
    from workbench.models import load_model

    loaded = load_model("smollm2", device="cuda")
    assert loaded.dtype == "bfloat16"
    engine = Engine(loaded, trace_level="off")
    outs = engine.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_new_tokens for o in outs)
    assert torch.cuda.is_available()


def test_latency_stages_add_up_to_end_to_end(tiny):
    engine = Engine(tiny, trace_level="summary", chunk_size=4)
    engine.add_request("warm up the engine", SamplingParams(temperature=0, max_new_tokens=4))
    out = engine.generate("a seeded request with a prompt longer than one chunk",
                          SamplingParams(temperature=0.8, seed=3, max_new_tokens=12))[0]
    t = out.timings
    assert set(t["stages"]) == {"tokenize", "queue", "wait", "schedule", "forward", "sample", "output"}
    assert all(v >= 0 for v in t["stages"].values())
    assert abs(sum(t["stages"].values()) - t["e2e"]) <= 0.05 * t["e2e"]
    assert t["stages"]["forward"] > 0 and t["ttft"] > 0 and len(t["itl"]) == len(out.token_ids) - 1
    stamps = [e for e in engine.memory_sink.of_kind("stamp") if e.req_id == out.req_id]
    assert [s.stage for s in stamps[:2]] == ["arrival", "tokenized"]
    assert sum(s.stage == "step" for s in stamps) == len(out.token_ids)


def test_prefix_sharing_copies_a_shared_system_prompt_and_changes_no_token(tiny):
    chats = [[{"role": "user", "content": f"Tell me about {topic}."}] for topic in ("cats", "the sea", "jazz", "bread")]
    chats.append([{"role": "user", "content": "x"}])  # shares the chat template's system prompt too
    plain = Engine(tiny, trace_level="off").generate(chats, GREEDY)
    engine = Engine(tiny, trace_level="summary", prefix_sharing=True)
    shared = engine.generate(chats, GREEDY)
    assert [o.token_ids for o in shared] == [o.token_ids for o in plain]
    cached = [o.usage["cached_prompt_tokens"] for o in shared]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    # the copied prefix is not computed again: fewer prompt tokens go through the model
    events = engine.memory_sink.events
    prefilled = sum(c["length"] for e in events if e.kind == "schedule" for c in e.prefill)
    assert prefilled == sum(o.usage["prompt_tokens"] for o in shared) - sum(cached)
    assert any(e.kind == "kv" and "first" in e.reason and "prompt tokens' KV" in e.reason for e in events)
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size


def test_pickled_weights_are_refused_without_unpickling(tiny, tmp_path, monkeypatch):
    """A model folder can be named by a trace file (replay), so `.bin` weights must never reach torch.load."""
    from workbench.models import load_model

    folder = tmp_path / "bin-only"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    for weights in folder.glob("*.safetensors"):  # transformers 5 writes only safetensors; make a .bin-only one
        weights.unlink()
    torch.save(tiny.model.state_dict(), folder / "pytorch_model.bin")
    assert any(folder.glob("*.bin")) and not any(folder.glob("*.safetensors"))

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called on an untrusted file")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(ValueError, match=r"model: .*no \.safetensors weights"):
        load_model(str(folder), device="cpu")


def _garbage_pool(engine: Engine) -> None:
    """Every KV slot but the padding row holds NaN now, and every freed slot gets NaN again: what
    `torch.empty` may hand out, at its worst. A slot read before it is written poisons the logits."""
    kv = engine.memory.kv
    for t in (*kv.k, *kv.v):
        t[1:] = float("nan")
    free = engine.memory.allocator.free

    def free_and_poison(slots):
        free(slots)
        for t in (*kv.k, *kv.v):
            t[slots.to(torch.int64)] = float("nan")

    engine.memory.allocator.free = free_and_poison


@pytest.mark.parametrize("kw", [dict(), dict(chunk_size=16, kv_tokens=260, max_batch_tokens=64),
                                dict(spec="ngram:k=3"), dict(prefix_cache=True), dict(torch_attention=True)],
                         ids=["batched", "chunked+preempting", "speculative", "prefix-cache", "torch-attention"])
def test_a_garbage_filled_kv_pool_gives_the_same_tokens_and_logprobs(tiny, kw):
    # The pool is allocated uninitialised (memory.py): this proves no slot is read before it is written,
    # through padding, chunked prefill, preemption (slots freed and reused), verify and cached prefixes.
    # Without the native kernels, padded decode rows gather row 0 (masked): it must stay finite.
    from workbench.engine.kernels.torch_paths import disabled

    kw = dict(kw)
    off = disabled(tiny.model) if kw.pop("torch_attention", False) else contextlib.nullcontext()
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=3)
    prompts = [*PROMPTS, list(range(10, 130)),
               [{"role": "user", "content": "Tell me about cats."}], [{"role": "user", "content": "And dogs?"}]]

    def run(poison: bool):
        engine = Engine(tiny, trace_level="off", **kw)
        if poison:
            _garbage_pool(engine)
        outs = engine.generate(prompts, params) + engine.generate(prompts[-2:], params)  # the cache is used
        return ([o.token_ids for o in outs], [[(t.logprob, [(i, lp) for i, _, lp in t.top_logprobs])
                                               for t in o.logprobs] for o in outs],
                sum(o.timings["preemptions"] for o in outs))

    with off:
        clean, poisoned = run(False), run(True)
    assert poisoned[0] == clean[0] and poisoned[1] == clean[1]
    assert not any(lp != lp for seq in poisoned[1] for lp, _ in seq)  # no NaN anywhere
    if "kv_tokens" in kw:
        assert poisoned[2] > 0  # slots really were freed and reused
