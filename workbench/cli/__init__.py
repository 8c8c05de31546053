"""The `workbench` command: one table of subcommands, each owned by the package it belongs to.

Owns: the top-level parser, dispatch, and the one error convention (a user error, a bad value or an
unreadable trace, prints one line and exits 2; no tracebacks). Each command's flags and its running
live with its package, as `add_*_args(parser)` and `run_*(args)`: the server's in server/cli_args.py,
the peers' in external/cli_args.py, the live proxy's in watch/cli_args.py, the re-runs' in rerun/cli_args.py, the load client's in
clients/cli_args.py, export's in trace/cli_args.py, the TUI's in tui/cli.py, and the engine's own
commands in cli/generate.py. A `run_*` does its heavy imports (torch, the engine, textual, fastapi)
itself, so `workbench --help` and the viewers start fast.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: its name and one-line help, and where its flags and its runner live."""

    name: str
    help: str
    module: str  # the owning package's module with `add_<x>_args` and `run_<x>`
    stem: str  # <x>

    def add(self, sub: argparse._SubParsersAction) -> None:
        # No prefix matching: `--max-new-token` is an error, not a guess.
        p = sub.add_parser(self.name, help=self.help, description=self.help, allow_abbrev=False)
        getattr(importlib.import_module(self.module), f"add_{self.stem}_args")(p)
        p.set_defaults(command_run=self.run)

    def run(self, args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(self.module), f"run_{self.stem}")(args) or 0)


COMMANDS = [
    Command("generate", "stream a completion to the terminal", "workbench.cli.generate", "generate"),
    Command("demo", "record a demo trace on the default model, then open the TUI", "workbench.cli.generate", "demo"),
    # `tui` parses its own flags (tui/cli.py); listed for --help, dispatched before parsing
    Command("serve", "OpenAI-compatible server with a live trace stream", "workbench.server.cli_args", "serve"),
    Command("client", "concurrent streaming requests: client vs server TTFT and inter-token latency",
            "workbench.clients.cli_args", "client"),
    Command("probe", "record any OpenAI-compatible server (vLLM, llama.cpp, SGLang) into a trace",
            "workbench.external.cli_args", "probe"),
    Command("check", "score a trace token by token against the reference model (teacher forcing)",
            "workbench.external.cli_args", "check"),
    Command("watch", "a proxy in front of any OpenAI-compatible server that checks a sample of its live "
            "traffic against the reference", "workbench.watch.cli_args", "watch"),
    Command("floor", "measure an engine's disagreement with itself (same requests twice, or two replicas)",
            "workbench.external.cli_args", "floor"),
    Command("resend", "re-send a recorded trace's requests to another upstream and record it like probe",
            "workbench.external.cli_args", "resend"),
    Command("import", "turn logged generations (RL rollouts: JSONL, Parquet) into a trace that check scores",
            "workbench.external.cli_args", "import"),
    Command("replay", "re-execute a trace and report the first divergence (--out saves the run)",
            "workbench.rerun.cli_args", "replay"),
    Command("diff", "line two traces up and report the first divergence, with a near-tie verdict",
            "workbench.rerun.cli_args", "diff"),
    Command("fork", "re-run a trace up to REQ:POSITION, force a token or change parameters there",
            "workbench.rerun.cli_args", "fork"),
    Command("invariance", "re-run each recorded request alone and in its batch: logprob drift, "
            "first differing token, near tie or not", "workbench.rerun.cli_args", "invariance"),
    Command("bisect", "the first layer and sub-block that adds error beyond its dtype's floor at REQ:POSITION, "
            "or which numerics a probed engine behaves like", "workbench.rerun.cli_args", "bisect"),
    Command("export", "export a trace to Perfetto JSON or a per-token table", "workbench.trace.cli_args", "export"),
    Command("make-traces", "regenerate the example traces in traces/", "workbench.cli.generate", "make_traces"),
]
TUI_HELP = "step through a trace, or follow a live server (FILE | --live URL; --step N --request ID --screenshot OUT.svg ...)"


def _bench_names() -> list[str]:
    """The benchmarks in benchmarks/ (a source checkout); empty when the folder is not there."""
    folder = _benchmarks_folder()
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def _benchmarks_folder() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _add_bench(sub: argparse._SubParsersAction) -> None:
    names = _bench_names()
    help = "run a benchmark from benchmarks/ (" + (", ".join(names) or "none found") + ")"
    p = sub.add_parser("bench", help=help, description=help, allow_abbrev=False)
    p.add_argument("name", choices=names or None, metavar="NAME",
                   help="one of: " + (", ".join(names) or "(no benchmarks/ folder)"))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")
    p.set_defaults(command_run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    script = _benchmarks_folder() / f"{args.name}.py"
    if not script.exists():
        raise ValueError(f"bench: no benchmark named {args.name!r} in benchmarks/")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from workbench import __version__

    parser = argparse.ArgumentParser(prog="workbench", description="See inside an LLM inference engine.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS[:2]:
        command.add(sub)
    sub.add_parser("tui", help=TUI_HELP, description=TUI_HELP, add_help=False)
    for command in COMMANDS[2:]:
        command.add(sub)
    _add_bench(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse; an unknown flag after a subcommand is reported with that subcommand's usage."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tui"]:  # the TUI parses its own options (tui/cli.py), --help included
        from tui.cli import main as tui_main

        return int(tui_main(argv[1:]) or 0)
    parser = build_parser()
    args = _parse(parser, argv)
    try:
        return int(args.command_run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"workbench {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
