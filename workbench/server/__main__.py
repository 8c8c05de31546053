"""`python -m workbench.server ...`: the same as `workbench serve ...`."""

import sys

from workbench.server.cli_args import serve_main

sys.exit(serve_main())
