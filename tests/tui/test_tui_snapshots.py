"""SVG snapshots of the main screen at three steps of the example trace (tests/tui/test_tui_fixtures.py).

A prefill step, the speculative step where req-1's third draft is rejected, and the step where the
stop string "\\n\\n" finishes req-0. The trace is written with fixed times, so every run renders
the same screen. Update with `pytest tests/tui/test_tui_snapshots.py --snapshot-update` and review
the SVGs in tests/tui/__snapshots__/test_tui_snapshots/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tui_pilot import SIZE, settle
from tui.app import WorkbenchApp


@pytest.mark.parametrize(("step", "request_id"), [(1, "req-0"), (3, "req-1"), (4, "req-0")],
                         ids=["prefill", "spec-rejection", "stop-string-finish"])
def test_main_screen(snap_compare, example_trace: Path, step: int, request_id: str) -> None:  # noqa: ANN001
    app = WorkbenchApp(str(example_trace), step=step, request=request_id)
    assert snap_compare(app, terminal_size=SIZE, run_before=settle)


@pytest.mark.parametrize("key", ["1", "3", "6"], ids=["batch", "tokens", "finish"])
def test_compact_screen_80x24(snap_compare, example_trace: Path, key: str) -> None:  # noqa: ANN001
    """An 80x24 terminal: the timeline beside one pane at a time, the pane bar naming all six."""
    app = WorkbenchApp(str(example_trace), step=3, request="req-1")
    assert snap_compare(app, terminal_size=(80, 24), press=[key], run_before=settle)
