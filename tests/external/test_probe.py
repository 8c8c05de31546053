"""`workbench probe` against real servers: this workbench's own `serve` (tiny-random, in its own
process), and a proxy in front of it that changes a token, cuts the connection (the server dies
mid-stream) or refuses logprobs.

What a user notices: the trace holds every token the server sent with the right ids (decoding them
gives the streamed text), its logprobs and top-k, finish reasons, usage and timings; it opens in
the reader, the TUI and the notebook, which say "not recorded" for what a server does not report;
`check` finds a changed token and names the request and position; a failure gives a clear message
and a trace with everything received; the API key never reaches the file.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pytest

from workbench.external.probe import probe
from workbench.external.records import ProbeRequest, load_prompts_jsonl
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.slow  # the module starts a server process once (20-40 s on a busy machine)

API_KEY = "sk-probe-test-secret-4242"
MAX_TOKENS = 10
REQUESTS = [
    ProbeRequest(prompt="The capital of France is"),
    ProbeRequest(messages=[{"role": "user", "content": "List three fruits."}]),
    ProbeRequest(prompt="Once upon a time", params={"temperature": 0.8, "seed": 7}),
    ProbeRequest(messages=[{"role": "user", "content": "Write a haiku."}], params={"temperature": 0.9, "seed": 3}),
]


@pytest.fixture(scope="module")
def server():
    from workbench.server.background import ServerProcess

    with ServerProcess(["--model", "tiny-random", "--api-key", API_KEY], start_timeout=180) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok():
    from workbench.external.token_ids import load_reference_tokenizer

    return load_reference_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def probed(server, tok, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("probe") / "own.wbtrace"
    result = probe(server.url + "/v1", REQUESTS, path, concurrency=4, max_tokens=MAX_TOKENS, api_key=API_KEY,
                   tokenizer=tok, progress=False)
    return path, result


def _probe_via(proxy: Any, tok: Any, path: Path, requests: list[ProbeRequest], **kw: Any) -> Any:
    return probe(proxy.url, requests, path, max_tokens=MAX_TOKENS, api_key=API_KEY, tokenizer=tok,
                 progress=False, **kw)


# --- this workbench's own server -----------------------------------------------------------------


def test_every_streamed_token_is_recorded_with_its_id_logprob_and_top_k(probed, tok) -> None:
    path, result = probed
    assert result.ok, result.errors
    assert result.model == "tiny-random"
    import uuid

    assert [uuid.UUID(r.req_id).version for r in result.records] == [4] * len(REQUESTS)  # llama.cpp needs it
    with open_trace(path) as trace:
        assert trace.meta["source"] == "external" and trace.finished
        finished = {r.req_id: r.finished for r in trace.requests()}
        assert len(finished) == len(REQUESTS)
        for rec in result.records:
            tl = trace.timeline(rec.req_id)
            fin = finished[rec.req_id]
            ids = [t.token_id for t in tl.tokens]
            assert len(ids) == MAX_TOKENS and fin.finish_reason == "length"
            assert tok.decode(ids) == fin.text == "".join(t.text for t in tl.tokens)  # ids recovered right
            assert all(t.source == "external_recovered" for t in tl.tokens)  # our server sends no ids
            assert all(t.logprob is not None and t.logprob <= 0 for t in tl.tokens)
            # completions' top-k is a dict keyed by text: tokens of the same text (two byte pieces
            # that both print as U+FFFD) collapse into one; chat lists every one
            k = [len(t.top_logprobs) for t in tl.tokens]
            assert all(n == 20 for n in k) if rec.request.is_chat else all(15 <= n <= 20 for n in k)
            assert all(t.top_logprobs[0][1] >= t.top_logprobs[-1][1] for t in tl.tokens)
            assert fin.usage["completion_tokens"] == MAX_TOKENS
            assert fin.usage["prompt_tokens"] == len(tl.added.prompt_ids)  # the reference tokenizer agrees
            timings = fin.timings
            assert 0 < timings["ttft"] <= timings["e2e"] and len(timings["itl"]) == MAX_TOKENS - 1
        greedy = [r.added.params["greedy"] for r in trace.requests()]
        assert greedy == [True, True, False, False]


def test_meta_holds_server_identity_and_metrics_but_never_the_key(probed) -> None:
    path, result = probed
    with open_trace(path) as trace:
        ext = trace.meta["external"]
        assert ext["identity"]["models"]["data"][0]["id"] == "tiny-random"
        assert ext["metrics_before"]["status"] == 200 and ext["metrics_after"]["status"] == 200
        assert ext["metrics_delta"], "the probe's requests moved the server's counters"
        assert "forward_batch" in trace.meta["not_recorded"] and "sampling" in trace.meta["not_recorded"]
        assert ext["fallbacks"] and "return_tokens_as_token_ids" in ext["fallbacks"][0]
    data = Path(path).read_bytes()
    assert API_KEY.encode() not in data and b"Bearer" not in data


def test_the_external_trace_shows_unreported_stages_as_not_recorded_in_the_notebook(probed) -> None:
    from workbench.notebook.viewer import TraceViewer

    path, result = probed
    viewer = TraceViewer(str(path), req_id=result.records[0].req_id, widgets=False)
    for name in ("stages", "batch", "finish", "spec"):
        notes = " ".join(a.text for a in viewer.figures[name].layout.annotations)
        assert "not recorded" in notes, name
    tokens = viewer.figures["tokens"].data[0]
    assert len(tokens.x) == MAX_TOKENS and all(y <= 0 for y in tokens.y)
    timing = viewer.figures["latency"]  # the client's view of the stream: TTFT, then each gap
    assert timing.layout.title.text.startswith("client timing: TTFT") and len(timing.data[0].y) == MAX_TOKENS
    assert html.escape(result.records[0].text) in viewer.summary_html()


@pytest.mark.anyio
async def test_the_external_trace_opens_in_the_tui_with_not_recorded_panes(probed) -> None:
    from tests.helpers.tui_pilot import pane, tui

    path, result = probed
    rec = result.records[1]
    step = next(e.step for e in open_trace(path).events(kind="token", req_id=rec.req_id))
    async with tui(path, step=step, request=rec.req_id) as (pilot, screen):
        assert "not recorded" in pane(screen, "batch") and "not recorded" in pane(screen, "sampling")
        assert "external" in screen.model.title()
        tokens = pane(screen, "tokens")
        assert "List three fruits" in tokens and "external_recovered" in tokens
        assert "client   TTFT" in tokens and "server timings not recorded" in tokens
        row = screen.timeline.visible_rows()[0].split()
        assert row[1:4] == ["chunk", "—", "—"]  # no batch size or forward tokens: never zeros


def test_replay_refuses_an_external_trace_and_points_to_check(probed) -> None:
    from workbench.rerun.replay import replay

    with pytest.raises(ValueError, match="workbench check TRACE --reference MODEL"):
        replay(str(probed[0]), progress=False)


def test_check_on_our_own_server_agrees_and_is_stored(probed) -> None:
    from workbench.external.check import check_trace
    from workbench.trace.checks import read_checks

    path, result = probed
    report = check_trace(path, "tiny-random", progress=False)
    assert report.exit_code == 0, report.render()
    greedy = [r for r in report.requests if r.greedy]
    assert all(r.agree == len(r.positions) == MAX_TOKENS for r in greedy)
    assert report.max_abs_delta is not None and report.max_abs_delta < 1e-3  # same fp32 model, same runner
    stored = read_checks(path)
    assert set(stored) == {r.req_id for r in result.records}
    assert all(p["verdict"] == "ok" for p in stored[result.records[0].req_id]["positions"])
    with open_trace(path) as trace:
        assert trace.meta["check"]["real_divergences"] == 0


# --- a proxy in front of the server ----------------------------------------------------------------


def test_a_changed_token_is_caught_and_named(server, tok, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.helpers.probe_proxy import Proxy
    from workbench.cli import main

    path = tmp_path / "tampered.wbtrace"
    with Proxy(server.url, mode="tamper", target_index=2, position=3) as proxy:
        result = _probe_via(proxy, tok, path, [ProbeRequest(prompt=p) for p in ("One", "Two", "Three")],
                            concurrency=3)
    assert result.ok and proxy.tampered is not None
    target = result.records[2].req_id
    assert result.records[2].tokens[3].text == proxy.tampered
    code = main(["check", str(path), "--reference", "tiny-random"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(target))
    assert "position 3 real" in line and repr(proxy.tampered) in line
    run = target.split("-")[0]
    others = [ln for ln in out.splitlines() if ln.strip().startswith(run) and target not in ln]
    assert len(others) == 2 and all(ln.rstrip().endswith("—") for ln in others)


def test_a_server_that_dies_mid_stream_leaves_a_readable_trace(server, tok, tmp_path: Path) -> None:
    from tests.helpers.probe_proxy import Proxy

    path = tmp_path / "died.wbtrace"
    with Proxy(server.url, mode="die", position=3) as proxy:
        result = _probe_via(proxy, tok, path, [ProbeRequest(prompt=p) for p in ("One", "Two", "Three")],
                            concurrency=1)
    assert not result.ok
    first = result.records[0]
    assert "connection dropped mid-stream after 3 chunks" in first.error
    # the next ones find it gone (or, on a kept-alive connection, cut as well)
    assert all(("cannot connect" in r.error or "connection dropped" in r.error or "before answering" in r.error)
               for r in result.records[1:])
    with open_trace(path) as trace:
        tokens = trace.timeline(first.req_id).tokens
        assert [t.text for t in tokens] == [t.text for t in first.tokens] and len(tokens) == 3
        fin = {r.req_id: r.finished for r in trace.requests()}
        assert all(f is not None and f.error for f in fin.values())
        assert trace.meta["external"]["errors"]


def test_a_server_that_refuses_logprobs_gets_a_clear_message(server, tok, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from tests.helpers.probe_proxy import Proxy
    from workbench.cli import main

    path = tmp_path / "refused.wbtrace"
    with Proxy(server.url, mode="refuse") as proxy:
        code = main(["probe", proxy.url, "--out", str(path), "--prompt", "One", "--prompt", "Two",
                     "--tokenizer", "tiny-random", "--api-key", API_KEY, "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the server refuses logprobs" in err and "logprobs are not supported" in err
    assert "not sent" in err  # the second request is not tried again
    with open_trace(path) as trace:
        assert len(trace.requests()) == 2


def test_a_wrong_api_key_stops_the_run_with_a_hint(server, tok, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"/v1/models answered HTTP 401: check --api-key"):
        probe(server.url, REQUESTS[:2], tmp_path / "denied.wbtrace", api_key="wrong", tokenizer=tok, progress=False)
    result = probe(server.url, REQUESTS[:2], tmp_path / "denied.wbtrace", api_key="wrong", tokenizer=tok,
                   progress=False, max_tokens=2, model="tiny-random")
    assert "HTTP 401" in result.errors[0] and "check --api-key" in result.errors[0]
    assert "not sent" in result.errors[1]


# --- inputs ----------------------------------------------------------------------------------------


def test_a_prompts_file_takes_strings_chats_and_per_request_fields(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = ['"Hello"', json.dumps([{"role": "user", "content": "Hi"}]),
             json.dumps({"prompt": "Seeded", "temperature": 0.7, "seed": 1}), ""]
    path.write_text("\n".join(lines))
    reqs = load_prompts_jsonl(path)
    assert [r.is_chat for r in reqs] == [False, True, False]
    assert reqs[2].params == {"temperature": 0.7, "seed": 1}
    path.write_text('"ok"\n{"prompt": "x", "temprature": 1}\n')
    with pytest.raises(ValueError, match=r"line 2: unknown fields \['temprature'\]"):
        load_prompts_jsonl(path)


def test_token_ids_come_from_the_server_when_it_sends_them(tok) -> None:
    from workbench.external.token_ids import TokenIds

    ids = TokenIds(tok)
    assert ids.resolve("token_id:7042") == (7042, "server")
    for tid in tok.encode(" The capital of France", add_special_tokens=False):
        assert ids.resolve(tok.decode([tid])) == (tid, "recovered")
    euro = tok.encode("€", add_special_tokens=False)  # a character split across byte tokens
    first = tok.convert_ids_to_tokens(euro[0])
    raw = ids._piece_bytes(first)
    assert ids.resolve("bytes:" + "".join(f"\\x{b:02x}" for b in raw)) == (euro[0], "recovered")
    assert ids.resolve("\ufffd", raw_bytes=list(raw)) == (euro[0], "recovered")
