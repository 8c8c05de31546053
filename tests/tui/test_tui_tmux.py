"""The real `workbench tui` command in a real terminal (tmux): keys in, the screen read back.

Needs the `tmux` binary (Debian package `tmux`; `make setup` installs it). Each test runs the
console script in a detached tmux session of 160x48 cells, sends keys with `tmux send-keys` and
reads the screen with `tmux capture-pane`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

WORKBENCH = shutil.which("workbench") or f"{sys.executable} -m workbench.cli"


class Terminal:
    """One detached tmux session running a command, on its own tmux server (no shared state)."""

    def __init__(self, command: str) -> None:
        self.name = f"wbtui-{uuid.uuid4().hex[:8]}"
        env = {"TERM": "xterm-256color", "COLORTERM": "truecolor"}
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        result = self.tmux("new-session", "-d", "-s", self.name, "-x", "160", "-y", "48",
                           f"cd {os.getcwd()} && env -u COLUMNS -u LINES {exports} {command}; echo EXITED $?; sleep 30")
        assert result.returncode == 0, result.stderr

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.name, "-f", "/dev/null", *args], capture_output=True, text=True,
                              timeout=20)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name).stdout

    def keys(self, *keys: str) -> None:
        for key in keys:
            self.tmux("send-keys", "-t", self.name, key)

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared; the screen was:\n{self.screen()}")

    def wait_gone(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text not in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never went away")

    def close(self) -> None:
        self.tmux("kill-server")


@pytest.fixture
def terminal_for(example_trace: Path) -> Iterator:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (apt-get install -y tmux)")
    opened: list[Terminal] = []

    def start(args: str, command: str = f"{WORKBENCH} tui") -> Terminal:
        term = Terminal(f"{command} {args}")
        opened.append(term)
        return term

    yield start
    for term in opened:
        term.close()


def test_workbench_tui_steps_searches_helps_and_quits(terminal_for, example_trace: Path) -> None:  # noqa: ANN001
    term = terminal_for(str(example_trace))
    screen = term.wait_for('"The capital of France is"')  # the prefill slice, decoded with the trace's tokenizer
    assert "step 1 (1/6)" in screen
    assert "ForwardBatch" in screen and "Logits & sampling" in screen and "Speculative" in screen
    term.keys("n")
    screen = term.wait_for("step 2 (2/6)")
    assert "MIXED" in screen.split("ForwardBatch")[1]
    term.keys("/")
    term.wait_for("text in the output")  # the search line is open (under load, keys sent sooner can be lost)
    term.keys("the rocks", "Enter")
    screen = term.wait_for("#2 rejected: u 0.570")  # the spec pane of the match's step
    assert "match at step 3, req-1 position 4" in screen and "✗ reject" in screen
    term.keys("?")
    screen = term.wait_for("Keys (escape closes)")
    assert "Follow the selected request" in screen
    term.keys("Escape")
    term.wait_gone("Keys (escape closes)")  # (a key sent right behind Escape would read as alt+key)
    term.keys("G")
    screen = term.wait_for("step 6 (6/6)")
    term.keys("q")
    term.wait_for("EXITED 0")


def test_python_m_tui_opens_at_a_step_and_request(terminal_for, example_trace: Path) -> None:  # noqa: ANN001
    term = terminal_for(f"{example_trace} --step 4 --request req-0", command=f"{sys.executable} -m tui")
    screen = term.wait_for("✓ fired")
    assert "step 4 (4/6)" in screen and "request req-0" in screen
    term.keys("q")
    term.wait_for("EXITED 0")


def test_workbench_tui_rejects_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    bad = tmp_path / "notes.wbtrace"
    bad.write_text("hello")
    result = subprocess.run([*WORKBENCH.split(), "tui", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "notes.wbtrace: not a workbench trace" in result.stderr and "Traceback" not in result.stderr


def test_screenshot_option_saves_the_screen_as_svg(example_trace: Path, tmp_path: Path) -> None:
    from tui import main

    out = tmp_path / "shot.svg"
    assert main([str(example_trace), "--step", "3", "--request", "req-1", "--screenshot", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and "ForwardBatch" in svg and "reject" in svg


def test_bad_arguments_name_the_option(example_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tui import main

    assert main(["--live", "ftp://host"]) == 2
    assert "--live must be an http(s) URL" in capsys.readouterr().err
    assert main([str(example_trace), "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "--tokenizer: no such file or folder" in capsys.readouterr().err
    assert main([str(example_trace), "--screenshot", str(tmp_path / "x.png")]) == 2
    assert "--screenshot must name an .svg file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # neither FILE nor --live: argparse's usage error
