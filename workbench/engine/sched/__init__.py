"""Scheduling: requests and their state, the scheduler (admission, chunked prefill, decode, preemption),
the paged KV pools and the prefix cache."""
