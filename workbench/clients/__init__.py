"""HTTP clients of OpenAI-compatible servers: the one SSE parser (sse.py), a timed stream
(stream.py), the `workbench client` load client (load.py, flags in cli_args.py) and the loopback
test both sides use (loopback.py). Imports neither the engine nor the server.
"""
