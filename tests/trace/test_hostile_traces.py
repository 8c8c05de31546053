"""Hostile trace files (issue 36, part 3): a huge payload, a million rows, JSON nested 100,000 deep, a
multi-megabyte prompt. The reader, the TUI's loader and the TUI itself, `workbench replay` and
`workbench check` either read such a file within bounded memory and time or stop with one line that
names the limit and the variable that raises it; peak RSS is measured in a child process that runs
under an address-space limit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.hostile_traces import DEPTH, HOSTILE, LIMITS_ENV, READ, VALUE
from workbench.cli import main as cli_main
from workbench.trace.limits import ENV, ReadLimits
from workbench.trace.reader import TraceError, open_trace

ROOT = Path(__file__).resolve().parents[2]
LIMITS = ReadLimits.from_env(LIMITS_ENV)
VARIABLE = {VALUE: ENV["max_value_mb"], DEPTH: ENV["max_depth"], READ: ENV["max_read_mb"]}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("hostile") / "good.wbtrace"
    with Engine("tiny-random", trace=str(path), trace_level="summary") as engine:
        engine.generate(["one", "two two", "three three three"],
                        SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True))
    return path


@pytest.fixture(scope="module")
def crafted(recorded: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The hostile copy of the good trace for one case (made once per module)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp("h") / (name.replace(" ", "-").replace(",", "") + ".wbtrace")
            shutil.copy(recorded, path)
            HOSTILE[name][0](path)
            made[name] = path
        return made[name]
    return make


def _names_the_limit(exc: BaseException, path: Path, limit: str) -> None:
    text = str(exc)
    assert isinstance(exc, TraceError), f"{type(exc).__name__}: {text[:300]}"
    assert text.startswith(path.name) and "\n" not in text and len(text) < 400, text
    assert limit in text and VARIABLE[limit] in text, text


READERS: dict[str, Callable] = {
    "steps": lambda t: t.steps(),
    "step(n)": lambda t: [t.step(s.step) for s in t.steps()[:20]],
    "requests": lambda t: t.requests(),
    "timeline": lambda t: [t.timeline(r.req_id) for r in t.requests()[:20]],
    "tokens_frame": lambda t: t.tokens_frame(),
    "events_frame": lambda t: t.events_frame(kind="request.added"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_every_reader_method_names_the_limit_or_reads_the_file(name: str, crafted: Callable[[str], Path]) -> None:
    path, limit = crafted(name), HOSTILE[name][1]
    try:
        trace = open_trace(path, LIMITS)
    except Exception as exc:  # the meta is read on opening
        assert limit is not None, f"a legal file was refused: {exc}"
        _names_the_limit(exc, path, limit)
        return
    refused = []
    with trace:
        for method, read in READERS.items():
            try:
                read(trace)
            except Exception as exc:
                assert limit is not None, f"{method} refused a legal file: {exc}"
                _names_the_limit(exc, path, limit)
                refused.append(method)
    assert bool(refused) == (limit is not None), f"{name}: refused by {refused}"


def test_the_limits_come_from_the_environment_and_are_checked() -> None:
    assert ReadLimits.from_env({}) == ReadLimits()
    assert ReadLimits.from_env({"WORKBENCH_TRACE_MAX_READ_MB": "8"}).max_read_mb == 8
    for env, named in (({"WORKBENCH_TRACE_MAX_DEPTH": "1"}, "WORKBENCH_TRACE_MAX_DEPTH"),
                       ({"WORKBENCH_TRACE_MAX_VALUE_MB": "lots"}, "WORKBENCH_TRACE_MAX_VALUE_MB"),
                       ({"WORKBENCH_TRACE_MAX_READ_MB": "-3"}, "WORKBENCH_TRACE_MAX_READ_MB")):
        with pytest.raises(ValueError, match=named):
            ReadLimits.from_env(env)


def test_raising_the_limit_reads_what_it_refused(crafted: Callable[[str], Path]) -> None:
    path = crafted("300,000 steps")  # the quickest of the cases over the read limit to read whole (5 s)
    with open_trace(path, LIMITS) as trace, pytest.raises(TraceError, match="the steps table"):
        trace.steps()
    with open_trace(path, ReadLimits(max_read_mb=2048)) as trace:
        steps = trace.steps()
    assert len(steps) >= 300_000 and steps[-1].step == 300_100 and steps[-1].mode == "DECODE"


# --- memory: the TUI's loader and the reader in a child process under an address-space limit ---------

CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a failure must not take the machine with it
from tui.model import TraceModel, open_source
errors, start = [], time.monotonic()
def attempt(fn):
    try:
        fn()
    except ValueError as exc:  # TraceError
        errors.append(str(exc))
try:
    model = TraceModel(open_source(sys.argv[1]))
    steps = model.steps()
    for info in steps[:40]:
        model.step_view(info.step, info)
    for info in model.requests()[:40]:
        model.request(info.req_id)
    attempt(lambda: model.source.tokens_frame())
    attempt(lambda: model.source.events_frame(kind="request.added"))
    attempt(lambda: sum(1 for _ in model.source.events(limit=200_000)))  # streamed: chunks of bounded size
except ValueError as exc:
    errors.append(str(exc))
problem = model.take_problem() if "model" in dir() else None
print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "errors": errors + ([problem] if problem else []), "seconds": time.monotonic() - start}))
"""


def _child(path: Path) -> dict:
    env = {**os.environ, **LIMITS_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def baseline(recorded: Path) -> dict:
    result = _child(recorded)
    assert not result["errors"], result
    return result


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_tui_loader_stays_within_its_memory_limit(name: str, crafted: Callable[[str], Path], baseline: dict) -> None:
    path, limit = crafted(name), HOSTILE[name][1]
    result = _child(path)
    if limit is None:
        assert not result["errors"], result
    else:
        assert result["errors"] and all(limit in e or "corrupt" in e for e in result["errors"]), result
    # bounded: what the loader's reads may build (its caches hold at most one read's limit) plus one value
    # per chunk, never the file's size times what JSON grows to in Python
    bound = 3 * LIMITS.max_read_mb + 4 * LIMITS.max_value_mb
    assert result["rss_mb"] - baseline["rss_mb"] < bound, (result["rss_mb"], baseline["rss_mb"], bound)


# --- the commands ----------------------------------------------------------------------------------------


def _one_error_line(capsys: pytest.CaptureFixture[str], path: Path, limit: str, *argv: str) -> None:
    code = cli_main(list(argv))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # (progress bars aside)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-1500:]
    assert path.name in errors[0] and limit in errors[0] and VARIABLE[limit] in errors[0], errors[0]


@pytest.mark.parametrize("name", ["a million rows in one step", "300,000 requests", "params nested 200 deep",
                                  "engine meta nested 100,000 deep", "a 10 MB payload"])
def test_replay_refuses_a_hostile_trace_by_its_limit(name: str, crafted: Callable[[str], Path],
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in LIMITS_ENV.items():
        monkeypatch.setenv(var, value)
    path = crafted(name)
    _one_error_line(capsys, path, HOSTILE[name][1], "replay", str(path))


@pytest.mark.parametrize("name", ["300,000 token events of one request", "300,000 requests", "a 10 MB payload",
                                  "top_logprobs nested 5,000 deep"])
def test_check_refuses_a_hostile_trace_by_its_limit(name: str, crafted: Callable[[str], Path],
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in LIMITS_ENV.items():
        monkeypatch.setenv(var, value)
    path = crafted(name)
    _one_error_line(capsys, path, HOSTILE[name][1], "check", str(path), "--reference", "tiny-random")


# --- the TUI itself ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["a million rows in one step", "300,000 token events of one request",
                                  "a 3 MB prompt", "a 3 MB token text", "300,000 steps"])
async def test_the_tui_keeps_running_and_names_the_limit(name: str, crafted: Callable[[str], Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.tui_pilot import settle
    from tui.app import WorkbenchApp

    for var, value in LIMITS_ENV.items():
        monkeypatch.setenv(var, value)
    path, limit = crafted(name), HOSTILE[name][1]
    app = WorkbenchApp(str(path))
    seen: list[str] = []
    async with app.run_test(size=(160, 48)) as pilot:
        for key in ["j", "j", "l", "r", "l", "n", "n", "p", "G"]:
            await pilot.press(key)
            # each selection's rows load in a worker, and the next key cancels a load that has not
            # started: wait for it as a user reading the step would (beside a full run on a 2-core VM
            # the keys once outran the load of the hostile step, which then never ran)
            await settle(pilot, timeout=30.0)
            seen.append(str(app.screen_stack[0].query_one("#status").render()))
        screen_text = app.export_screenshot()
        assert app.is_running
    if limit is not None:
        assert any(limit in s for s in seen), seen[-3:]
    else:
        assert not any("corrupt" in s or "limit" in s for s in seen), seen[-3:]
        assert "…" in screen_text  # the long text is shown cut, not laid out whole


@pytest.mark.parametrize("name", ["300,000 token events of one request", "a 10 MB payload", "engine meta nested 100,000 deep",
                                  "a payload nested 100,000 deep"])
def test_export_and_diff_refuse_a_hostile_trace_by_its_limit(name: str, crafted: Callable[[str], Path], recorded: Path,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in LIMITS_ENV.items():
        monkeypatch.setenv(var, value)
    path = crafted(name)
    _one_error_line(capsys, path, HOSTILE[name][1], "export", str(path), "--tokens", str(tmp_path / "t.csv"))
    _one_error_line(capsys, path, HOSTILE[name][1], "diff", str(recorded), str(path))
