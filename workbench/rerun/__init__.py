"""Re-running recorded traces: an engine rebuilt from a trace's meta and its requests re-submitted.

rebuild.py (the engine and requests as recorded), replay.py (re-execute and name the first
difference), fork.py (branch at one token), invariance.py (each request alone vs in its batch),
cli_args.py (their commands, and `diff`). Stands above `trace/` and `engine/`: it needs both.
"""
