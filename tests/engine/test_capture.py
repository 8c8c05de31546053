"""Inside the forward pass (issue 18): what capture stores equals transformers' own numbers.

Hidden states against `output_hidden_states=True`, attention weights against eager
`output_attentions=True`, the last layer's logit lens against the logits the sampler saw, for a
request alone and the same request inside a mixed batch with chunked prefill; the capture setting's
validation; capture off leaves no hooks and no capture events.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.run.capture_spec import CaptureSpec
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model
from workbench.trace.recorder import MemorySink

PROMPT = "Hello there, how are you doing today? I was thinking"
GREEDY = SamplingParams(temperature=0, max_new_tokens=5)
OTHERS = ["The quick brown fox jumps over", "Once upon a time", "1, 2, 3, 4,", "Paris is the capital of"]


@functools.lru_cache(maxsize=4)
def eager_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def run_captured(loaded, capture, *, others: bool = False, prompt: str = PROMPT, **engine_kw):
    """Run PROMPT captured (alone, or joining four running requests); returns (engine, sink, req_id)."""
    sink = MemorySink()
    engine = Engine(loaded, trace_level="full", trace_sinks=[sink], **engine_kw)
    if others:
        for p in OTHERS:
            engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=12))
        engine.step()
        engine.step()  # the others are decoding when the captured prompt arrives
    (rid,) = engine.add_request(prompt, GREEDY, capture=capture)
    while engine.has_work():
        engine.step()
    return engine, sink, rid


def reference(loaded, engine: Engine, rid: str):
    """transformers' hidden states and eager attentions for the request's whole sequence."""
    req = engine.reqs[rid]
    seq = list(req.prompt_ids) + list(engine.finished[rid].token_ids)
    model = eager_model(str(loaded.folder))
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True, output_attentions=True)
    return model, len(req.prompt_ids), out


def assert_equals_transformers(loaded, engine, sink, rid, rtol: float = 0.0) -> dict[int, np.ndarray]:
    """Every captured position against transformers: within 1e-4 absolute (plus `rtol` for a model
    whose residual entries reach the tens, where float32 itself is only good to ~1e-5 relative)."""
    model, prompt_len, out = reference(loaded, engine, rid)
    caps = [c for c in sink.of_kind("capture") if c.req_id == rid]
    assert [c.position for c in caps] == list(range(GREEDY.max_new_tokens))
    hidden_by_pos = {}
    for c in caps:
        row = prompt_len - 1 + c.position  # the sequence position whose logits chose output `position`
        hidden = torch.from_numpy(sink.tensors[c.tensors["hidden"]])  # [layers + 1, hidden]
        want = torch.stack([h[0, row] for h in out.hidden_states])
        # transformers' last entry is after the final norm; ours is the residual itself
        torch.testing.assert_close(hidden[:-1], want[:-1], atol=1e-4, rtol=rtol)
        torch.testing.assert_close(model.model.norm(hidden[-1]), want[-1], atol=1e-4, rtol=rtol)
        attn = torch.from_numpy(sink.tensors[c.tensors["attention"]])  # [layers, heads, kv_len]
        assert c.kv_len == row + 1
        torch.testing.assert_close(attn, torch.stack([a[0, :, row, :row + 1] for a in out.attentions]),
                                   atol=1e-4, rtol=0)
        norms = sink.tensors[c.tensors["norms"]]
        np.testing.assert_allclose(norms, np.linalg.norm(hidden.numpy(), axis=-1), rtol=1e-5)
        hidden_by_pos[c.position] = hidden.numpy()
    return hidden_by_pos


def assert_last_lens_is_the_sampler(sink, rid) -> None:
    for c in (c for c in sink.of_kind("capture") if c.req_id == rid):
        seen = torch.log_softmax(torch.from_numpy(sink.tensors[f"logits/{c.step}/{rid}/{c.position}"]), -1)
        ids = sink.tensors[c.tensors["lens_ids"]][-1]
        np.testing.assert_allclose(sink.tensors[c.tensors["lens_logprobs"]][-1], seen[ids].numpy(), atol=1e-4)
        assert ids[0] == c.token_id  # greedy: the last layer's top token is the one chosen
        assert sink.tensors[c.tensors["lens_chosen_rank"]][-1] == 1
        assert c.lens_texts[-1][0] == next(t.text for t in sink.of_kind("token")
                                           if t.req_id == rid and t.position == c.position)


@pytest.mark.parametrize("family", ["tiny-random", "tiny-random:gemma2", "tiny-random:gpt_oss"])
def test_captured_alone_and_in_a_chunked_mixed_batch_equal_transformers(family):
    loaded = load_model(family, device="cpu")
    prompt = PROMPT * (1 if family == "tiny-random" else 3)  # past the 32-token windows of gemma2, gpt_oss
    capture = {"attention_whole": True}
    alone = run_captured(loaded, capture, prompt=prompt)
    batched = run_captured(loaded, capture, others=True, prompt=prompt, chunk_size=4, max_batch_tokens=8)
    engine, sink, rid = batched
    decisions = sink.of_kind("schedule")
    chunks = [d for d in decisions if any(p["req_id"] == rid for p in d.prefill)]
    assert len(chunks) > 1 and any(d.mode == "MIXED" for d in chunks)  # chunked, beside decodes
    h_alone = assert_equals_transformers(loaded, *alone)
    h_batched = assert_equals_transformers(loaded, *batched)
    for pos, h in h_alone.items():  # the batch does not change the numbers
        np.testing.assert_allclose(h_batched[pos], h, atol=1e-4, rtol=0)
    assert_last_lens_is_the_sampler(alone[1], alone[2])
    assert_last_lens_is_the_sampler(sink, rid)


def test_top_k_attention_and_entropy_are_the_whole_weights_summarised(tiny):
    engine, sink, rid = run_captured(tiny, {"attention_topk": 3})
    _, prompt_len, out = reference(tiny, engine, rid)
    c = sink.of_kind("capture")[-1]
    assert "attention" not in c.tensors
    row = prompt_len - 1 + c.position
    whole = torch.stack([a[0, :, row, :row + 1] for a in out.attentions])
    vals, pos = whole.topk(3, dim=-1)
    np.testing.assert_allclose(sink.tensors[c.tensors["attention_weights"]], vals.numpy(), atol=1e-4)
    assert (sink.tensors[c.tensors["attention_positions"]] == pos.numpy()).mean() > 0.99  # ties may swap
    ent = -(whole * whole.clamp_min(1e-30).log()).sum(-1)
    np.testing.assert_allclose(sink.tensors[c.tensors["attention_entropy"]], ent.numpy(), atol=1e-4)


def test_positions_first_n_and_margin_choose_what_is_captured(tiny):
    _, sink, rid = run_captured(tiny, {"positions": 2, "what": ["lens"]})
    caps = sink.of_kind("capture")
    assert [c.position for c in caps] == [0, 1] and set(caps[0].tensors) == {
        "lens_ids", "lens_logprobs", "lens_chosen_logprob", "lens_chosen_rank"}
    margins = {}
    for t in sink.of_kind("token"):  # the top-2 margin of each position, from the first run's trace
        p = sorted((np.exp(lp) for _, lp, _ in t.top_logprobs), reverse=True)
        margins[t.position] = p[0] - p[1]
    ordered = sorted(margins.values())
    threshold = float(ordered[1] + ordered[2]) / 2  # between two positions' margins, not on one
    want = [pos for pos, m in sorted(margins.items()) if m < threshold]
    assert want and len(want) < len(margins)  # both kinds of positions
    _, sink, rid = run_captured(tiny, {"margin": threshold, "what": ["norms"]})
    caps = sink.of_kind("capture")
    assert [c.position for c in caps] == want
    assert all(c.margin < threshold and set(c.tensors) == {"norms"} for c in caps)


def test_engine_wide_capture_covers_the_named_requests_only(tiny):
    sink = MemorySink()
    engine = Engine(tiny, trace_sinks=[sink], capture={"requests": ["b"], "what": ["norms"]})
    for rid in ("a", "b"):
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=3), req_id=rid)
    while engine.has_work():
        engine.step()
    assert {c.req_id for c in sink.of_kind("capture")} == {"b"}
    assert all(name.startswith("capture/") for name in sink.tensors)  # summary level: only captured tensors


def test_capture_off_registers_no_hooks_and_records_nothing(tiny, monkeypatch):
    sink = MemorySink()
    engine = Engine(tiny, trace_sinks=[sink])
    seen = []
    original = engine.runner.model.forward

    def watch(*a, **kw):
        layers = engine.runner.model.model.layers
        seen.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in layers))
        return original(*a, **kw)

    monkeypatch.setattr(engine.runner.model, "forward", watch)  # the shared model gets its forward back after
    engine.generate([PROMPT], GREEDY)
    assert seen and seen == [0] * len(seen)
    assert not sink.of_kind("capture") and not sink.tensors
    engine.add_request(PROMPT, GREEDY, capture=True)
    while engine.has_work():
        engine.step()
    assert max(seen) == len(engine.runner.model.model.layers) + 1  # while captured: one per layer + the pre-hook
    assert sum(len(m._forward_hooks) for m in engine.runner.model.model.layers) == 0  # removed after


@pytest.mark.parametrize(("capture", "message"), [
    ({"positions": 0}, r"capture\.positions must be 'all' or an int >= 1"),
    ({"margin": 1.5}, r"capture\.margin must be None or a top-2 probability margin in \(0, 1\]"),
    ({"what": ["hidden", "mlp"]}, r"capture\.what must be a non-empty list of"),
    ({"lens_topk": 0}, r"capture\.lens_topk must be an int in \[1, 100\]"),
    ({"attention_topk": True}, r"capture\.attention_topk must be an int in \[1, 4096\]"),
    ({"layers": 3}, r"capture: unknown keys \['layers'\]"),
    ("yes", r"capture must be True, a dict or a CaptureSpec"),
])
def test_bad_capture_settings_are_refused_naming_the_parameter(tiny, capture, message):
    engine = Engine(tiny)
    with pytest.raises(ValueError, match=message):
        engine.add_request(PROMPT, GREEDY, capture=capture)
    assert not engine.has_work()  # nothing was queued
    with pytest.raises(ValueError, match=message):
        Engine(tiny, capture=capture)


def test_capture_needs_a_trace_and_no_speculation(tiny):
    with pytest.raises(ValueError, match="trace_level must be 'summary' or 'full'"):
        Engine(tiny, trace_level="off", capture=True)
    with pytest.raises(ValueError, match="trace_level must be 'summary' or 'full'"):
        Engine(tiny, trace_level="off").add_request(PROMPT, GREEDY, capture=CaptureSpec(what=("lens",)))


@pytest.mark.slow
def test_smollm2_captured_inside_a_batch_equals_transformers(smollm2):
    engine, sink, rid = run_captured(smollm2, {"attention_whole": True}, others=True, chunk_size=8,
                                     max_batch_tokens=16)
    assert_equals_transformers(smollm2, engine, sink, rid, rtol=1e-5)  # 4 of 17,280 entries ~57 differ by 1.4e-4
    assert_last_lens_is_the_sampler(sink, rid)
