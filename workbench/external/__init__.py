"""See inside the engines users run: record any OpenAI-compatible server and check it against the reference.

- `probe(url, requests, out, ...) -> ProbeResult` (probe.py): stream requests to vLLM, SGLang,
  llama.cpp or this workbench's own server and write what came back (tokens and their ids,
  logprobs, top-k, chunk times, finish and stop reasons, usage, the server's identity and
  `/metrics`) as an ordinary `.wbtrace` file with `meta.source = "external"`.
- `check_trace(path, reference, ...) -> CheckReport` (check.py): teacher-force each request's prompt
  and output through the reference model, and say where and how the engine diverged.
- `ProbeRequest`, `load_prompts_jsonl` (records.py): what to send.
- `measure_floor`, `load_floor`, `Floor` (floor.py): how much an engine disagrees with itself,
  which `check_trace(..., floor=)` and `diff_traces(..., floor=)` classify against.
- `resend(trace, to, out)` (resend.py): a recorded trace's requests sent to another upstream.
- `import_generations(file, out)`, `import_request_outputs(outputs, out)` (imports.py): logged RL
  rollouts (TRL, verl, vLLM) as a trace; `check_trace` then reports importance ratios (importance.py).

Real peer engines (vLLM CPU, llama.cpp) are started by peers.py; OTLP spans are received by
otlp.py. Re-exports are lazy: importing this package imports neither httpx nor torch.
"""

from __future__ import annotations

_LAZY = {
    "probe": "workbench.external.probe",
    "ProbeResult": "workbench.external.records",
    "ProbeRequest": "workbench.external.records",
    "RequestRecord": "workbench.external.records",
    "load_prompts_jsonl": "workbench.external.records",
    "check_trace": "workbench.external.check",
    "DEFAULT_TOLERANCE": "workbench.external.check",
    "CheckReport": "workbench.external.check_report",
    "RequestCheck": "workbench.external.check_report",
    "PositionCheck": "workbench.external.check_report",
    "measure_floor": "workbench.external.floor",
    "load_floor": "workbench.external.floor",
    "Floor": "workbench.external.floor",
    "resend": "workbench.external.resend",
    "import_generations": "workbench.external.imports",
    "import_request_outputs": "workbench.external.imports",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.external' has no attribute {name!r}")
