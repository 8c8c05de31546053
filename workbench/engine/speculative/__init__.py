"""Speculative decoding: its config, the drafters (n-gram, draft model, early exit), the verify step
and the worker that runs them."""
