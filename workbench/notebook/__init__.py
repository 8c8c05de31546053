"""Notebook viewers: `TraceViewer` for a recorded trace, `LiveView` for a running engine, and the
plotly figures and helpers the tutorial notebooks use.

Imports plotly and ipywidgets, never workbench.engine: an engine is read through its tracer only.
Everything reusable by the notebooks lives here; the notebooks hold no library code.
"""

from workbench.notebook.data import EventSource, RequestView, TraceSource, as_source
from workbench.notebook.figures import (
    batch_figure,
    finish_figure,
    show_token,
    spec_figure,
    stages_figure,
    tokens_figure,
)
from workbench.notebook.inside import InsideViewer, answer_layer, attention_figure, lens_figure
from workbench.notebook.live import LiveView
from workbench.notebook.tutorial import (
    acceptance_by_position,
    acceptance_figure,
    compare_figure,
    detok_table,
    divergence_figure,
    final_distribution,
    rejections,
    stage,
    stage_table,
)
from workbench.notebook.viewer import PANELS, TraceViewer
from workbench.notebook.whatif import DiffView, InvarianceView

__all__ = [
    "PANELS", "DiffView", "EventSource", "InsideViewer", "InvarianceView", "LiveView", "RequestView", "TraceSource", "TraceViewer", "acceptance_by_position",
    "acceptance_figure", "answer_layer", "as_source", "attention_figure", "batch_figure", "compare_figure", "detok_table", "divergence_figure",
    "final_distribution", "finish_figure", "lens_figure", "rejections", "show_token", "spec_figure", "stage", "stage_table",
    "stages_figure", "tokens_figure",
]
