"""Traces whose header is valid and whose contents are not (issue 19): every reader method, `workbench
diff`, `export` and `replay` report one clear line naming the file and what is wrong, and the TUI keeps
running, showing the damage in its status line instead of dying with WorkerFailed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.trace_damage import DAMAGES as ALL_DAMAGES
from workbench.cli import main as cli_main
from workbench.trace.reader import TraceError, open_trace


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("damaged") / "good.wbtrace"
    with Engine("tiny-random", trace=str(path), trace_level="summary") as engine:
        engine.generate(["one", "two two", "three three three"],
                        SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True))
    return path


# the issue's list; the sweep (benchmarks/hardening_sweep.py) runs the whole catalogue
DAMAGES = {name: ALL_DAMAGES[name] for name in (
    "bit-flipped page", "payload not JSON", "payload not an object", "unknown event kind", "token position a string",
    "token id a string", "token logprob a list", "model meta a string", "engine meta a list",
    "step req_ids not JSON", "run member without a request")}


@pytest.fixture(params=list(DAMAGES), scope="module")
def damaged(request: pytest.FixtureRequest, recorded: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("d") / (request.param.replace(" ", "-") + ".wbtrace")
    shutil.copy(recorded, path)
    DAMAGES[request.param](path)
    return path


def _one_line(exc: BaseException, path: Path) -> None:
    text = str(exc)
    assert isinstance(exc, TraceError), f"{type(exc).__name__}: {text}"
    assert text.startswith(path.name) and "\n" not in text and len(text) < 400, text


READERS: dict[str, Callable] = {
    "steps": lambda t: t.steps(),
    "step(n)": lambda t: [t.step(s.step) for s in t.steps()],
    "events": lambda t: list(t.events()),
    "requests": lambda t: t.requests(),
    "timeline": lambda t: [t.timeline(r.req_id) for r in t.requests()],
    "steps_frame": lambda t: t.steps_frame(),
    "tokens_frame": lambda t: t.tokens_frame(),
    "events_frame": lambda t: t.events_frame(),
    "tensor_names": lambda t: t.tensor_names(),
    "check": lambda t: t.check(),
    "last_complete_step": lambda t: t.last_complete_step,
}


def test_every_reader_method_reports_damage_as_one_line(damaged: Path) -> None:
    try:
        trace = open_trace(damaged)
    except Exception as exc:  # damage the opening checks catch
        _one_line(exc, damaged)
        return
    failures = 0
    with trace:
        for read in READERS.values():
            try:
                read(trace)
            except Exception as exc:
                _one_line(exc, damaged)
                failures += 1
    assert failures or "meta" in damaged.name, "the damage went unnoticed by every reader method"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli_main(list(argv))
    return code, capsys.readouterr().err


def test_diff_and_export_report_damage_in_one_line(damaged: Path, recorded: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["diff", str(recorded), str(damaged)],
                 ["export", str(damaged), "--perfetto", str(tmp_path / "p.json"), "--tokens", str(tmp_path / "t.csv")]):
        code, err = _cli(capsys, *argv)
        assert code in (0, 1, 2), err
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and damaged.name in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("kind", ["model meta a string", "engine meta a list", "payload not an object"])
def test_replay_reports_damage_in_one_line(kind: str, recorded: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.wbtrace"
    shutil.copy(recorded, path)
    DAMAGES[kind](path)
    code, err = _cli(capsys, "replay", str(path))
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # (progress bars aside)
    assert code == 2 and len(errors) == 1 and path.name in errors[0] and "Traceback" not in err, err


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["bit-flipped page", "token position a string"])
async def test_the_tui_keeps_running_and_shows_the_damage(kind: str, recorded: Path, tmp_path: Path) -> None:
    from tui.app import WorkbenchApp

    path = tmp_path / "t.wbtrace"
    shutil.copy(recorded, path)
    DAMAGES[kind](path)
    app = WorkbenchApp(str(path))
    seen: list[str] = []
    async with app.run_test(size=(160, 48)) as pilot:
        for key in ["j"] * 5 + ["l", "r", "G", "slash", *"zz", "enter"]:
            await pilot.press(key)
            await pilot.pause(0.02)
            seen.append(str(app.screen_stack[0].query_one("#status").render()))
        await pilot.pause(0.3)
        seen.append(str(app.screen_stack[0].query_one("#status").render()))
        assert app.is_running
    assert any(path.name in s and ("corrupt" in s or "damaged" in s) for s in seen), seen[-3:]


def test_damage_list_covers_the_issue() -> None:
    assert {"bit-flipped page", "payload not JSON", "payload not an object", "unknown event kind",
            "model meta a string"} <= set(DAMAGES)
    assert json.loads('"tiny-random"') == "tiny-random"
