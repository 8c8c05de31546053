"""`workbench export T --perfetto OUT.json --tokens OUT.parquet|csv`: its flags and running it.

Owns: the command's wiring to trace/export.py. Imports no engine (the trace package never does).
"""

from __future__ import annotations

import argparse


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace")
    p.add_argument("--perfetto", metavar="OUT.json")
    p.add_argument("--tokens", metavar="OUT.parquet|csv")


def run_export(args: argparse.Namespace) -> int:
    from workbench.trace.export import export_perfetto, export_tokens
    from workbench.trace.reader import open_trace

    if not args.perfetto and not args.tokens:
        raise ValueError("export: give --perfetto OUT.json and/or --tokens OUT.parquet|csv")
    with open_trace(args.trace) as trace:
        if args.perfetto:
            export_perfetto(trace, args.perfetto)
            print(f"perfetto trace: {args.perfetto}")
        if args.tokens:
            export_tokens(trace, args.tokens)
            print(f"token table: {args.tokens}")
    return 0
