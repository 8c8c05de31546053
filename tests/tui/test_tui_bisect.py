"""The TUI opens what `workbench bisect` stored (issue 35): `b` on a token of a bisected request.

On the designed example trace with designed stored results (so the picture is the same on every
machine): req-1 bisected at position 2 against bfloat16 (the MLP of layer 2 over its floor) with a
behaves-like fit there, and at position 4 against chunked prefill (a context: growth per layer).
The Tokens pane says where a result is stored; `b` opens the overlay at the selected position with
the per-layer error and the ranking, `n` moves to the next stored position, escape closes; a request
without a result says how to make one. A snapshot shows the overlay.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.tui_pilot import SIZE, pane, settle, tui
from tui.app import WorkbenchApp
from tui.screens.bisect import BisectScreen
from workbench.trace.bisect_store import read_bisects, store_bisect

pytestmark = pytest.mark.anyio


def _layer(i: int, added: float, floor: float, total: float, blocks: dict[str, float] | None = None,
           carried: float | None = 0.0) -> dict:
    return {"layer": i, "added": added, "propagated": carried, "total": total, "floor": floor, "norm": 10.0,
            "ratio": added / floor, "blocks": [{"block": b, "added": r * floor, "floor": floor, "ratio": r}
                                               for b, r in (blocks or {}).items()]}


def _store_designed(path: Path) -> None:
    pick = {"token_id": 1, "text": " the", "logprob": -0.2, "margin": 1.5}
    base = {"req_id": "req-1", "reference": "smollm2 float32 exact", "factor": 1.0, "recorded_token": 1,
            "reference_pick": pick, "embed_error": 0.004}
    store_bisect(path, {**base, "key": "req-1:2:bfloat16", "position": 2, "against": "bfloat16", "kind": "numerics",
                        "suspect_pick": {**pick, "text": " a", "margin": 0.1}, "first_layer": 2, "first_block": "mlp",
                        "note": "the suspect picks ' a' where the reference picks ' the'",
                        "layers": [_layer(0, 0.1, 0.3, 0.1, {"self_attn": 0.4, "mlp": 0.3}),
                                   _layer(1, 0.2, 0.4, 0.25, {"self_attn": 0.5, "mlp": 0.6}, 0.1),
                                   _layer(2, 3.0, 0.5, 3.1, {"self_attn": 0.6, "mlp": 7.5}, 0.3),
                                   _layer(3, 0.4, 0.6, 3.4, {"self_attn": 0.7, "mlp": 0.5}, 3.1)]})
    store_bisect(path, {"key": "req-1:2:behaves-like", "req_id": "req-1", "position": 2, "against": "behaves-like",
                        "positions": [0, 1, 2, 3, 4], "best": "bfloat16", "best_text": "the reference in bfloat16",
                        "candidates": [{"numerics": n, "median_abs_delta": d, "deltas": {}, "note": ""}
                                       for n, d in (("bfloat16", 0.0), ("chunked:8", 0.11), ("float32", 0.18),
                                                    ("fast", 0.25))]})
    store_bisect(path, {**base, "key": "req-1:4:chunked:8", "position": 4, "against": "chunked:8", "kind": "context",
                        "suspect_pick": pick, "first_layer": 0, "first_block": "layer", "note": "",
                        "layers": [_layer(i, g, 5e-6, t, carried=None)
                                   for i, (g, t) in enumerate(((2e-5, 2e-5), (2e-6, 2.2e-5), (0.0, 2.1e-5),
                                                               (3e-5, 5e-5)))]})


@pytest.fixture
def bisected(example_trace: Path, tmp_path: Path) -> Path:
    path = tmp_path / "bisected.wbtrace"
    shutil.copy(example_trace, path)
    _store_designed(path)
    assert len(read_bisects(path)) == 3
    return path


async def _to(pilot, screen, position: int) -> None:  # noqa: ANN001
    await pilot.press(*["l"] * position)
    await settle(pilot)
    assert screen.sel.position == position


async def test_b_opens_the_stored_bisect_and_n_walks_its_positions(bisected: Path) -> None:
    async with tui(bisected, step=1, request="req-1") as (pilot, screen):
        await _to(pilot, screen, 2)
        assert "bisect stored here · b opens it" in pane(screen, "tokens")
        await pilot.press("b")
        await pilot.pause(0.1)
        overlay = pilot.app.screen
        assert isinstance(overlay, BisectScreen)
        text = overlay.text()
        assert "req-1:2" in text and "vs bfloat16" in text
        assert "first layer over its floor: layer 2, MLP" in text and "MLP 7.5x" in text
        assert "behaves like bfloat16: the reference in bfloat16" in text
        ranking = text[text.index("behaves like"):].splitlines()[1:]
        assert [line.lstrip("▸ ").split()[0] for line in ranking[:4]] == ["bfloat16", "chunked:8", "float32", "fast"]
        await pilot.press("n")
        text = overlay.text()
        assert "req-1:4" in text and "vs chunked:8" in text and "growth" in text
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not isinstance(pilot.app.screen, BisectScreen)
        await pilot.press("h")  # back to position 1: no result there
        await settle(pilot)
        assert screen.sel.position == 1
        assert "bisect stored at positions 2, 4" in pane(screen, "tokens")


async def test_a_request_without_a_bisect_says_how_to_make_one(bisected: Path) -> None:
    async with tui(bisected, step=1, request="req-0") as (pilot, screen):
        assert "bisect" not in pane(screen, "tokens")
        await pilot.press("b")
        await pilot.pause(0.1)
        assert not isinstance(pilot.app.screen, BisectScreen)
        assert any("workbench bisect FILE --at req-0:POS" in str(n.message) for n in pilot.app._notifications)


def test_the_bisect_overlay(snap_compare, bisected: Path) -> None:  # noqa: ANN001
    app = WorkbenchApp(str(bisected), step=1, request="req-1")

    async def open_it(pilot) -> None:  # noqa: ANN001
        await settle(pilot)
        await pilot.press("l", "l")
        await settle(pilot)
        await pilot.press("b")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_it)
