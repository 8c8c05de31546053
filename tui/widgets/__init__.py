"""The TUI's widgets, one module per pane (plus the timeline, status line and command line)."""
