"""Small terminals (under 30 rows, e.g. 80x24): the step's panes become tabs, one shown at a time.

Owns: the pane bar (`PaneBar`: every pane's number and name, the shown one highlighted), the keys
that pick a pane (`1`-`6`, which also focus it; a pane focused by a click is shown), `z`, which maximizes the
focused pane at any terminal size (Textual's own maximize; `z` or Escape again restores), and `i`, which
shows or hides the layers pane. The
layout itself is tui.tcss's `.-compact` rules. Mixed into the main screen; draws no pane.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.widgets import Static

# the right column's panes in tab order: (key, widget id, name); their containers in tui.tcss
PANES = (("1", "batch", "Batch"), ("2", "sampling", "Sample"), ("3", "tokens", "Tokens"),
         ("4", "detok", "Detok"), ("5", "spec", "Spec"), ("6", "finish", "Finish"))
COLUMN = {"tokens": "#col-left", "detok": "#col-left", "spec": "#col-right", "finish": "#col-right"}


# the main screen adds these to its BINDINGS (Textual merges bindings from DOMNode classes only)
COMPACT_BINDINGS = [Binding(key, f"show_pane('{pane_id}')", f"Focus the {name} pane (small terminals: show it)", show=False)
                    for key, pane_id, name in PANES] + [
    Binding("z", "toggle_maximize", "Maximize the focused pane (toggle)", show=False),
    Binding("i", "toggle_layers", "Layers pane: inside the forward (toggle; shown by itself for captured traces)",
            show=False)]


class PaneBar(Static):
    """`1:Batch 2:Sample 3:Tokens ...`, the shown pane highlighted (visible in compact mode only)."""

    def set_active(self, active: str) -> None:
        parts = []
        for key, pane_id, name in PANES:
            style = "bold reverse" if pane_id == active else "dim"
            parts += [(f"{key}:", "bold"), (name, style), " "]
        self.update(Text.assemble(*parts), layout=False)


class CompactPanes:
    """Mixin for the main screen: which pane the compact layout shows, and maximize."""

    shown_pane = "batch"

    def show_pane(self, pane_id: str) -> None:
        """Make `pane_id` the pane the compact layout shows (harmless at full size: classes only)."""
        self.shown_pane = pane_id
        for _, other, _ in PANES:
            self.query_one(f"#{other}").set_class(other == pane_id, "-shown")
        self.query_one("#lower").set_class(pane_id in COLUMN, "-shown")
        for column in ("#col-left", "#col-right"):
            self.query_one(column).set_class(COLUMN.get(pane_id) == column, "-shown")
        self.query_one(PaneBar).set_active(pane_id)

    def action_show_pane(self, pane_id: str) -> None:
        self.show_pane(pane_id)
        self.query_one(f"#{pane_id}").focus()

    def action_toggle_maximize(self) -> None:
        if self.maximized is not None:
            self.minimize()
        elif self.focused is not None:
            self.maximize(self.focused)

    def action_toggle_layers(self) -> None:
        self.query_one("#layers").toggle()

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        pane_id = event.widget.id
        if pane_id in {p for _, p, _ in PANES} and pane_id != self.shown_pane:
            self.show_pane(pane_id)
