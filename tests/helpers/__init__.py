"""Shared test helpers: reference runs, prompts, statistics, hand-made traces, the TUI pilot, the
browser. Test modules import from here (or get fixtures from conftest.py), never from each other."""
