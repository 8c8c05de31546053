"""`python -m tui FILE | --live URL`: the same as `workbench tui`."""

import sys

from tui.cli import main

sys.exit(main(prog="python -m tui"))
