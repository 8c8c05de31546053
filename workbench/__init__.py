"""LLM Engine Workbench: a traced, SGLang-shaped inference engine and the tools to look inside it.

Re-exports are lazy: `import workbench` (or `import workbench.trace`) loads neither torch nor
transformers, so viewers start fast on machines with no model.
"""

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("workbench.engine.engine", "Engine"),
    "SamplingParams": ("workbench.engine.sample.sampling_params", "SamplingParams"),
    "RequestOutput": ("workbench.engine.output.output", "RequestOutput"),
    "open_trace": ("workbench.trace.reader", "open_trace"),
    "fork": ("workbench.rerun.fork", "fork"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
