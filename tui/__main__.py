"""`python -m tui FILE | --live URL`: the same as `workbench tui`."""

import sys

from tui import main

sys.exit(main(prog="python -m tui"))
