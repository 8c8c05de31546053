"""Regenerates docs/trace_view.png: `workbench export --perfetto` of traces/speculative.wbtrace, opened
in a real trace viewer in headless Chromium.

The viewer is speedscope (https://www.speedscope.app, the npm package `speedscope`), which reads the
Chrome trace-event JSON the export writes, runs from local files and needs no network. Perfetto's
own UI (ui.perfetto.dev) is a web app served from Google's site and could not be loaded on the
offline machine this picture was made on, and Debian's Chromium 156 no longer opens the legacy
chrome://tracing viewer ("Internal debugging pages are currently disabled"). The export is written
for ui.perfetto.dev (Open trace file); that was not checked here.

    python docs/trace_view_picture.py [--trace traces/speculative.wbtrace] [--speedscope DIR]

Needs Debian's chromium, the playwright package (dev extra) and, without --speedscope, npm (it
fetches the speedscope package with `npm pack` into a temporary folder).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEEDSCOPE = "speedscope@1.25.0"
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def speedscope_release(tmp: Path) -> Path:
    """speedscope's built web app (dist/release), from the npm registry."""
    subprocess.run(["npm", "pack", SPEEDSCOPE, "--silent"], cwd=tmp, check=True, capture_output=True, timeout=300)
    tarball = next(tmp.glob("speedscope-*.tgz"))
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "package" / "dist" / "release"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # no request log on stderr
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--trace", default="traces/speculative.wbtrace")
    ap.add_argument("--speedscope", default=None, metavar="DIR", help="an unpacked speedscope dist/release folder")
    ap.add_argument("--out", default=str(ROOT / "docs" / "trace_view.png"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        site = tmp / "site"
        shutil.copytree(Path(args.speedscope) if args.speedscope else speedscope_release(tmp), site)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-m", "workbench.cli", "export", args.trace, "--perfetto",
                        str(site / "trace.json")], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
        handler = functools.partial(_Quiet, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 420})
                page.goto(f"{url}/index.html#profileURL={url}/trace.json&title={Path(args.trace).name}",
                          timeout=120_000)
                page.wait_for_selector("canvas", timeout=60_000)
                page.wait_for_timeout(3000)  # the flame chart draws after the profile is parsed
                page.screenshot(path=args.out, clip={"x": 0, "y": 0, "width": 1400, "height": 190})
                browser.close()
        finally:
            server.shutdown()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
