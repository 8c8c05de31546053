"""The TUI's screens: the main step-through screen and the help overlay."""
