"""The incremental detokenizer, on SmolLM2's byte-level BPE and a SentencePiece byte-fallback tokenizer.

What a user notices: the streamed text equals `tokenizer.decode(ids)`, nothing shown is ever taken
back, no broken character (U+FFFD) flashes in the stream of valid text, stop strings never leak
into the stream, and token ids after a stop string are dropped.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.engine.output.detokenizer import IncrementalDetokenizer, render_ids
from workbench.trace.events import DetokState, event_loads

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# text that exercises multi-byte characters split across tokens: CJK, emoji (with ZWJ and
# variation selectors), combining marks, runs of spaces and newlines
PIECES = [*"abcdefghij XYZ.,!?\n\t", *"世界漢字日本語한국어", "😀", "🎉", "👍🏽", "👩\u200d💻", "❤\ufe0f",
          "\u0301", "\u0308", "é", "ñ", "   "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@pytest.fixture(scope="session", params=["smollm2", "sentencepiece"])
def tok(request: pytest.FixtureRequest) -> Any:
    name = "smollm2_tokenizer" if request.param == "smollm2" else "sp_tokenizer"
    return request.getfixturevalue(name)


def stream(tok: Any, ids: list[int], groups: list[int], **kw: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push `ids` in groups of the given sizes (cycled); check at every step that nothing is taken back."""
    d = IncrementalDetokenizer(tok, **kw)
    skip = kw.get("skip_special_tokens", True)
    deltas, i, g = [], 0, 0
    while i < len(ids) and not d.finished:
        n = groups[g % len(groups)] if groups else 1
        u = d.push(ids[i:i + n])
        i, g = i + n, g + 1
        deltas.append(u.delta)
        assert d.text == "".join(deltas)  # each delta appends to what was shown
        if not u.finished_by_stop and not kw.get("stop"):
            # shown + held is exactly what decode gives for the ids so far
            assert d.text + u.held_text == render_ids(
                tok, ids[:i], skip_special_tokens=skip,
                spaces_between_special_tokens=kw.get("spaces_between_special_tokens", True))
            assert u.decoded_len == len(d.text) + len(u.held_text)
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("tok", ["smollm2", "sentencepiece"], indirect=True)
@PROPS
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans(),
       groups=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_random_ids_stream_equals_decode(tok: Any, data: st.DataObject, skip: bool, spaces: bool,
                                         groups: list[int]) -> None:
    # random ids anywhere in the vocabulary, specials included; plus ids from the low range,
    # which holds the specials and (for SentencePiece) the <0xNN> byte tokens
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.integers(0, 300)), max_size=24))
    _, deltas = stream(tok, ids, groups, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    # neither test tokenizer's decoder puts spaces around specials, so both settings give decode()
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("tok", ["smollm2", "sentencepiece"], indirect=True)
@PROPS
@given(text=TEXT, groups=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_random_text_streams_without_broken_characters(tok: Any, text: str, groups: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    _, deltas = stream(tok, ids, groups)
    final = "".join(deltas)
    assert final == tok.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in final:  # valid text: no delta may show half a character
        assert not any("\ufffd" in d for d in deltas)


def test_smollm2_roundtrips_text_exactly(smollm2_tokenizer: Any) -> None:
    text = "Hello 世界 😀 e\u0301 👩\u200d💻!\n\n  x"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    _, deltas = stream(smollm2_tokenizer, ids, [1])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_held_back_while_a_character_is_incomplete(tok: Any) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    updates = [d.push([i]) for i in ids]
    held = [u for u in updates if u.held_reason == "incomplete_char"]
    assert held, "the emoji spans several tokens, so part of it must be held"
    assert all("😀" not in u.delta and "\ufffd" not in u.delta for u in held)
    assert "".join(u.delta for u in updates) + d.flush() == tok.decode(ids)


def test_flush_releases_an_unfinished_character_as_decode_shows_it(tok: Any) -> None:
    ids = tok.encode("ab 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    d, deltas = stream(tok, ids, [1])
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


def test_prompt_ids_keep_the_first_tokens_leading_space(sp_tokenizer: Any) -> None:
    prompt = sp_tokenizer.encode("the quick", add_special_tokens=False)
    out = sp_tokenizer.encode(" brown fox", add_special_tokens=False)
    plain = IncrementalDetokenizer(sp_tokenizer)
    seeded = IncrementalDetokenizer(sp_tokenizer, prompt_ids=prompt)
    assert plain.push(out).delta + plain.flush() == "brown fox" == sp_tokenizer.decode(out)
    assert seeded.push(out).delta + seeded.flush() == " brown fox"
    whole = sp_tokenizer.decode(prompt + out)
    assert whole.endswith(seeded.text) and whole == sp_tokenizer.decode(prompt) + seeded.text


def test_decoding_work_per_token_stays_bounded(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("The engine streams text token by token, 世界 😀. " * 150, add_special_tokens=False)
    d = IncrementalDetokenizer(smollm2_tokenizer)
    widest = 0
    for i in ids:
        u = d.push([i])
        widest = max(widest, len(d.output_ids) - u.prefix_offset)  # ids decoded by this push
    assert len(ids) > 1500 and widest <= 8
    assert d.text + d.flush() == smollm2_tokenizer.decode(ids)


def test_update_becomes_a_detok_state_trace_event(sp_tokenizer: Any) -> None:
    d = IncrementalDetokenizer(sp_tokenizer, stop=["fox"])
    u = d.push(sp_tokenizer.encode("the quick brown f", add_special_tokens=False))
    assert u.held_reason == "possible_stop" and u.held_text.endswith("f")
    ev = DetokState(step=3, req_id="r1", **u.trace_fields())
    assert event_loads(ev.dumps()) == ev


class _SpacedStub:
    """A minimal tokenizer-like object whose decoder puts a space between every two tokens."""

    vocab = ["<s>", "</s>", "hi", "yo"]
    added_tokens_decoder = {0: SimpleNamespace(special=True), 1: SimpleNamespace(special=True)}
    all_special_ids = [0, 1]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < 2))


@pytest.mark.parametrize(("spaces", "expected"), [(True, "hi <s> </s> yo"), (False, "hi <s></s> yo")])
def test_spaces_between_special_tokens(spaces: bool, expected: str) -> None:
    ids = [2, 0, 1, 3]
    _, deltas = stream(_SpacedStub(), ids, [1], skip_special_tokens=False,
                       spaces_between_special_tokens=spaces)
    assert "".join(deltas) == expected
    _, skipped = stream(_SpacedStub(), ids, [1], spaces_between_special_tokens=spaces)
    assert "".join(skipped) == "hi yo"


def test_specials_shown_when_not_skipped(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("Hi<|im_end|><|im_start|>assistant", add_special_tokens=False)
    for spaces in (True, False):
        _, deltas = stream(smollm2_tokenizer, ids, [1], skip_special_tokens=False,
                           spaces_between_special_tokens=spaces)
        assert "".join(deltas) == "Hi<|im_end|><|im_start|>assistant"
    assert json.dumps(deltas)  # plain strings, ready for SSE


# --- stop strings ----------------------------------------------------------------------------------

WORDS = ["the", " quick", " brown", " fox", " jumps", " over", " 世界", " 😀", "!", "\n", " <", "/", ">", " END"]


@pytest.mark.parametrize("tok", ["smollm2", "sentencepiece"], indirect=True)
@PROPS
@given(words=st.lists(st.sampled_from(WORDS), min_size=2, max_size=14), data=st.data(), include=st.booleans(),
       groups=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_stop_string_never_leaks_and_later_ids_are_dropped(
        tok: Any, words: list[str], data: st.DataObject, include: bool, groups: list[int]) -> None:
    ids = tok.encode("".join(words), add_special_tokens=False)
    full = tok.decode(ids)
    a = data.draw(st.integers(0, len(full) - 1))
    stop = full[a:a + data.draw(st.integers(2, 6))]  # often spans token boundaries
    d, deltas = stream(tok, ids, groups, stop=[stop], include_stop_str_in_output=include)
    text = "".join(deltas)
    if stop not in full.replace("\ufffd", ""):  # e.g. half an emoji: can never match
        return
    assert d.stop_matched == stop
    assert text == full[:full.index(stop) + (len(stop) if include else 0)]
    assert text.count(stop) == (1 if include else 0)  # shown once when included, never otherwise
    assert not include or text.endswith(stop)
    kept = d.output_ids
    assert kept == ids[:len(kept)]  # ids after the completing token are dropped ...
    assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])  # ... and no more


def push_one_by_one(tok: Any, text: str, **kw: Any) -> tuple[IncrementalDetokenizer, list[Any], list[int]]:
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, **kw)
    updates = []
    for i in ids:
        updates.append(d.push([i]))
        if d.finished:
            break
    return d, updates, ids


def test_earliest_completed_stop_wins(tok: Any) -> None:
    # "quick brown fox" starts first, but "own" is complete before it
    d, _, _ = push_one_by_one(tok, "the quick brown fox jumps over", stop=["fox jumps", "quick brown fox", "own"])
    assert d.stop_matched == "own" and d.text == "the quick br"
    # a later-starting string that completes first beats an earlier-starting longer one
    d, _, _ = push_one_by_one(tok, "the quick brown fox jumps", stop=["quick brown fox jumps", "brown"])
    assert d.stop_matched == "brown" and d.text == "the quick "


def test_stops_completing_at_the_same_character_pick_the_earliest_start(tok: Any) -> None:
    for stops in (["rown", "brown", "own"], ["own", "brown", "rown"]):
        d, _, _ = push_one_by_one(tok, "the quick brown fox", stop=stops)
        assert d.stop_matched == "brown" and d.text == "the quick "


def test_stop_in_a_pushed_group_drops_the_rest(tok: Any) -> None:
    ids = tok.encode("the quick brown fox jumps over", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["brown"])
    u = d.push(ids)  # e.g. several accepted speculative tokens at once
    assert u.finished_by_stop and u.stop_matched == "brown" and u.delta == "the quick "
    assert u.new_ids == ids[:u.stop_token_index] == d.output_ids
    assert "brown" in tok.decode(d.output_ids) and "brown" not in tok.decode(d.output_ids[:-1])
    with pytest.raises(RuntimeError):
        d.push(ids[-1:])
    assert d.flush() == ""


def test_possible_stop_is_held_then_released(tok: Any) -> None:
    d, updates, ids = push_one_by_one(tok, "the quick </b and more", stop=["</b>"])
    assert any(u.held_reason == "possible_stop" for u in updates)
    assert d.text + d.flush() == tok.decode(ids)  # no match: everything comes out in the end


def test_included_stop_cuts_text_after_it_in_the_same_token(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("say hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(smollm2_tokenizer, stop=["hel"], include_stop_str_in_output=True)
    u = d.push(ids)
    assert d.text == "say hel" and u.stop_token_index == 2  # " hello" completed it


def test_stop_strings_wait_for_min_new_tokens(tok: Any) -> None:
    ids = tok.encode("fox and fox and fox", add_special_tokens=False)
    first = next(k for k in range(1, len(ids) + 1) if "fox" in tok.decode(ids[:k]))
    d = IncrementalDetokenizer(tok, stop=["fox"], min_new_tokens=first)
    for i in ids:
        d.push([i])
        if d.finished:
            break
    assert d.stop_matched == "fox" and d.text.startswith("fox and ") and d.text.count("fox") == 1


def test_bad_stop_strings_are_rejected(sp_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(sp_tokenizer, stop=[""])
