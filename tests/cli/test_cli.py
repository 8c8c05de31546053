"""The `workbench` command as a user types it: --version, per-subcommand errors, no prefix matching,
bench's choices, sampling flags refused before the model loads, and a --help that imports nothing heavy."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from workbench import __version__
from workbench.cli import _bench_names, main
from workbench.engine.sample.sampling_params import SamplingParams


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys) -> None:
    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"workbench {__version__}"


def test_unknown_flag_is_reported_by_its_subcommand(capsys) -> None:
    rc, _, err = _run(capsys, "generate", "hi", "--bogus")
    assert rc == 2
    assert err.startswith("usage: workbench generate")
    assert "workbench generate: error: unrecognized arguments: --bogus" in err


def test_abbreviated_flag_is_refused(capsys) -> None:
    rc, _, err = _run(capsys, "generate", "hi", "--max-new-token", "3")
    assert rc == 2 and "unrecognized arguments: --max-new-token" in err
    rc, _, err = _run(capsys, "serve", "--max-run", "3")
    assert rc == 2 and "workbench serve: error" in err


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--temperature", "nan"),
                                        ("--top-p", "inf"), ("--top-k", "-5"), ("--max-new-tokens", "0")])
def test_bad_sampling_flag_fails_before_the_model_loads(capsys, flag: str, value: str) -> None:
    rc, _, err = _run(capsys, "generate", "hi", "--model", "no-such-model", flag, value)
    name = flag[2:].replace("-", "_")
    assert rc == 2 and f"error: {name} must be" in err
    assert "loading" not in err  # refused before any model was looked up


def test_bench_lists_its_choices(capsys) -> None:
    names = _bench_names()
    assert "throughput" in names and "startup" in names
    rc, out, _ = _run(capsys, "bench", "--help")
    assert rc == 0 and all(n in out for n in names)
    rc, _, err = _run(capsys, "bench", "nope")
    assert rc == 2 and "invalid choice: 'nope'" in err and "throughput" in err


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", math.nan),
                                         ("temperature", math.inf), ("top_p", 0.0), ("min_p", 1.5),
                                         ("n", 0), ("max_new_tokens", True), ("presence_penalty", 3.0),
                                         ("logit_bias", {1: math.nan})])
def test_sampling_params_refuses_bad_values_when_constructed(field: str, value) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_help_imports_nothing_heavy() -> None:
    code = ("import sys, contextlib, io\n"
            "from workbench.cli import main\n"
            "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['client', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "heavy = [m for m in ('torch', 'transformers', 'fastapi', 'textual', 'httpx', 'numpy') if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
