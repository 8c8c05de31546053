"""Regenerates docs/replay_report.svg and docs/diff_report.svg: what `workbench replay` and `workbench
diff` print, run for real on traces/concurrent_chats.wbtrace (smollm2, CPU) and drawn as terminal SVGs
with rich (`Console(record=True).save_svg`), the way the TUI's own screenshots are made.

- replay: the trace replayed with a chunk size of 8 instead of the recorded one, once with
  `--compare tokens` (exit 0: every token the same) and once with `--compare steps` (the first
  schedule change, named with the override it follows from);
- diff: `workbench fork` at req-1 position 5 with the runner-up forced (`rank:2`), then
  `workbench diff PARENT FORK`: the shared prefix and where and how the continuations differ.

    python docs/report_pictures.py [--trace traces/concurrent_chats.wbtrace]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

ROOT = Path(__file__).resolve().parent.parent


def workbench(*args: str) -> str:
    """`$ workbench ARGS` and what it printed on stdout (progress bars on stderr are left out)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode not in (0, 1):  # 1: a replay that diverged, which is what it reports
        raise SystemExit(f"workbench {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    shown = [a if " " not in a else repr(a) for a in args]
    return f"$ workbench {' '.join(shown)}\n{done.stdout.rstrip()}\n[exit {done.returncode}]\n"


def save(text: str, out: Path, title: str) -> None:
    width = min(max(len(line) for line in text.splitlines()) + 1, 140)
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    body = Text()
    for line in text.splitlines():
        body.append(line + "\n", style="bold green" if line.startswith("$ ") else "")
    console.print(body, end="")
    console.save_svg(str(out), title=title)
    print(f"wrote {out.relative_to(ROOT)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--trace", default="traces/concurrent_chats.wbtrace")
    ap.add_argument("--only", choices=["replay", "diff"], default=None, help="draw one of the two pictures")
    args = ap.parse_args()
    if args.only != "diff":
        replay_picture(args.trace)
    if args.only != "replay":
        diff_picture(args.trace)


def replay_picture(trace: str) -> None:
    replay = (workbench("replay", trace, "--override", "engine.chunk_size=8", "--compare", "tokens")
              + "\n" + workbench("replay", trace, "--override", "engine.chunk_size=8", "--compare", "steps"))
    save(replay, ROOT / "docs" / "replay_report.svg", "workbench replay")


def diff_picture(trace: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fork = str(Path(tmp) / "fork.wbtrace")
        text = workbench("fork", trace, "--at", "req-1:5", "--token", "rank:2", "--out", fork)
        lines = text.replace(fork, "fork.wbtrace").splitlines()
        text = "\n".join([lines[0], "  ...", *lines[-2:]]) + "\n\n"  # fork prints the same diff: shown once
        text += workbench("diff", trace, fork).replace(fork, "fork.wbtrace")
    save(text, ROOT / "docs" / "diff_report.svg", "workbench fork, then workbench diff")


if __name__ == "__main__":
    main()
