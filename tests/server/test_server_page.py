"""The live page in headless Chromium: while a request runs, its tokens appear coloured by probability
(checked on the screenshot's pixels, twice, with more coloured pixels the second time) and the step
table shows the batch the request ran in; the page's own form streams an answer.

Needs Debian's chromium (`apt-get install -y chromium`) and the `playwright` Python package (its
API drives /usr/bin/chromium; playwright's own browser download is not used). Without chromium the
module's tests fail, saying why (a browser check that cannot run is not a pass).
"""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest


@pytest.fixture(autouse=True)
def _needs_chromium(chromium: str) -> None:  # every test here drives the browser: fails without one
    pass


MODEL = "tiny-random"

# Token backgrounds are hsl(0..120, 75%, 78%): light, saturated, red through yellow to green, so blue is
# the smallest channel. Nothing else on the requests panel has that colour.
COUNT_TOKEN_PIXELS = """async (src) => {
  const img = new Image(); img.src = src; await img.decode();
  const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
  const ctx = c.getContext("2d"); ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    const r = d[i], g = d[i + 1], b = d[i + 2], hi = Math.max(r, g, b), lo = Math.min(r, g, b);
    if (hi - lo > 60 && b <= lo + 2 && hi > 200) n++;
  }
  return n;
}"""


@pytest.fixture(scope="module")
def server(page_server):
    return page_server


class LongStream:
    """A streaming completion kept open on a thread until `close()`: a request that is running."""

    def __init__(self, url: str) -> None:
        self.url, self.req_id, self.ended_at = url, None, None
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 1500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and self.req_id is None:
                    self.req_id = json.loads(line[6:])["id"]
                    self.started.set()
                if self.stop.is_set():
                    break
        self.ended_at = time.monotonic()

    def __enter__(self) -> LongStream:
        self.thread.start()
        assert self.started.wait(120), "the request did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def _token_pixels(browser, png: bytes) -> int:
    page = browser.new_page()
    try:
        return page.evaluate(COUNT_TOKEN_PIXELS, "data:image/png;base64," + base64.b64encode(png).decode())
    finally:
        page.close()


def test_page_shows_tokens_streaming_while_a_request_runs(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=60_000)
    assert _token_pixels(browser, page.locator("#requests").screenshot()) == 0  # nothing coloured before
    count = "document.querySelectorAll('.req.running .tok').length"
    with LongStream(server.url) as stream:
        page.wait_for_function(f"{count} >= 8", timeout=120_000)
        first = page.locator("#requests").screenshot()
        n1 = page.evaluate(count)
        page.wait_for_function(f"{count} >= {n1 + 12}", timeout=120_000)
        second = page.locator("#requests").screenshot()
        page.screenshot(path=str(tmp_path / "live-page.png"))  # left for a human who wants to look
        assert stream.ended_at is None, "the screenshots must be taken while the request runs"
        card_id = page.evaluate("document.querySelector('.req.running b').textContent")
        chips = page.evaluate("[...document.querySelectorAll('#steps .chip')].map(c => c.textContent)")
        assert card_id == stream.req_id
        assert any(chip.startswith(stream.req_id[-6:]) for chip in chips), chips
    p1, p2 = _token_pixels(browser, first), _token_pixels(browser, second)
    assert p1 > 200 and p2 > p1, (p1, p2)
    page.wait_for_function("document.querySelector('.req .state')?.textContent === 'abort'", timeout=60_000)
    page.close()


def test_page_form_streams_an_answer(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=60_000)
    page.fill("#prompt", "Say something")
    page.fill("#max-tokens", "12")
    page.click("#try button")
    page.wait_for_function("document.querySelector('.req .state')?.textContent === 'length'", timeout=120_000)
    answer = page.evaluate("document.getElementById('answer').textContent")
    shown = page.evaluate("[...document.querySelectorAll('.req .tok')].length")
    assert answer.strip() and shown == 12
    page.close()
