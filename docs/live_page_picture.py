"""Regenerates docs/live_page.png: `workbench serve`'s live page in headless Chromium while three chat
requests stream on smollm2 (CPU). Needs Debian's chromium and the playwright package (dev extra).

    python docs/live_page_picture.py [--model smollm2] [--out docs/live_page.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_latency import start_server  # noqa: E402  (the benchmarks' launcher: own process, waits for /health)

PROMPTS = ["Write a haiku about a lighthouse.", "Explain what a KV cache is in two sentences.",
           "List three primary colours."]
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def stream(url: str, model: str, prompt: str, new: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new,
            "temperature": 0.7, "seed": 1, "stream": True, "logprobs": True, "top_logprobs": 3}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{prompt!r}: HTTP {resp.status_code} {resp.read()[:200]!r}")
        for _ in resp.iter_lines():
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(ROOT / "docs" / "live_page.png"))
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(args.model, args.port)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=60_000)
            threads = [threading.Thread(target=stream, args=(url, model, p, n), daemon=True)
                       for p, n in zip(PROMPTS, (48, 200, 200))]
            for t in threads:
                t.start()
                time.sleep(0.3)
            threads[0].join()  # one finished (its waterfall drawn), two still streaming
            time.sleep(2.0)
            page.screenshot(path=args.out)
            browser.close()
            for t in threads:
                t.join()
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"wrote {args.out} ({model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
