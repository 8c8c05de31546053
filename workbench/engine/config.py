"""The engine's configuration as one typed record (`EngineConfig`), as a trace's run metadata shows it.

Owns: `EngineArgs` (what a caller chooses, with the defaults: the one place they live; `Engine`,
the CLI and the server read them from here, and `EngineArgs.from_recorded` rebuilds the arguments of
a recorded run), `EngineConfig` (with `kernels`, the numerics mode: "exact" or the opt-in "fast") and
`CpuKernels` (which native paths ran, so a trace says it: a replay elsewhere may take the torch paths) and their JSON form, `to_dict()`, whose keys and order are the `engine`
entry of every trace's meta (the example traces in traces/ depend on it). Does not own: validating
the arguments (Engine.__init__ and the parts it builds) or the speculative config (speculative/config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# the numerics modes (`kernels`): the default, then run/fastmode.py's opt-in non-exact ones
KERNELS = ("exact", "fast", "fast-int8")


@dataclass(frozen=True, slots=True)
class CpuKernels:
    decode_attention: bool  # the native CPU decode-attention kernel ran (CPU, fp32, extension built)
    packed_linear_bytes: int  # bytes of weights repacked for the native linear kernels
    # every checked replacement (engine/kernels/: Book.report()): the switch, the verdict store, and
    # per replacement what it replaces, how it is checked and its verdicts; "fast" in fast mode.
    # Traces before 2026-12-05 hold an older shape here (per kernel family); nothing reads it back
    checks: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Any  # the model spec it was loaded from
    device: str
    dtype: Any
    max_batch_tokens: int
    chunk_size: int
    kv_tokens: int
    max_running: int
    enable_mixed: bool
    trace_topk: int
    seed: int
    prefix_sharing: bool
    prefix_cache: bool
    spec: str | dict[str, Any] | None  # as given, or the SpecConfig's dict
    # "exact" (the default: transformers' numbers) or "fast" (run/fastmode.py: bf16 GEMMs and fused
    # ops, output may differ; cpu_kernels.checks["fast"] says what ran). Traces before it: "exact".
    kernels: str
    cpu_kernels: CpuKernels
    # the order free KV slots are handed out in (sched/memory.py, KV_SLOT_ORDERS): "restart" (from
    # slot 1 again whenever all are free) or "fifo". Traces before it: "fifo"
    kv_slot_order: str = "restart"

    def to_dict(self) -> dict[str, Any]:
        """The trace meta's `engine` entry (keys in field order)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """What a caller chooses about an engine (`Engine(model, EngineArgs(...))` or `Engine(model, **fields)`).

    The defaults live here and nowhere else. An `EngineConfig` is what these resolve to at load (the
    device and dtype found, the KV pool sized, which native kernels the runner chose).
    """

    device: str = "auto"  # auto, cpu or cuda[:N]
    dtype: str | None = None  # None: the model's (float32 on CPU, bfloat16 on CUDA)
    huge_pages: bool = False  # CPU weights copied into 2 MB pages at load (models/loader.load_model): serve's choice
    max_batch_tokens: int = 2048  # tokens one forward may hold (prefill chunks + decodes)
    chunk_size: int = 512  # a prompt is prefilled in chunks of at most this many tokens
    kv_tokens: int | None = None  # KV pool slots; None: max_running x context, capped at 1 GiB of KV
    max_running: int = 64  # requests decoding at once
    enable_mixed: bool = True  # prefill chunks and decodes in one forward (MIXED)
    trace_topk: int = 10  # alternatives recorded per sampling stage
    spec: Any = None  # speculative decoding: "ngram:k=4", "draft:MODEL", "early-exit:layers=N", a SpecConfig
    seed: int = 0  # the engine's seed (requests with their own seed get their own generator)
    prefix_sharing: bool = True  # a prompt starting like one still prefilling copies its KV
    prefix_cache: bool = False  # keep finished requests' KV for later prompts (LRU)
    max_model_len: int | None = None  # a shorter context than the model's
    kernels: str = "exact"  # KERNELS: exact (transformers' numbers) or the opt-in fast modes
    kv_slot_order: str = "restart"  # sched/memory.py KV_SLOT_ORDERS
    grammar_limits: Any = None  # structured output's limits and compile budgets (GrammarLimits); None: defaults

    # what a recorded EngineConfig keeps of these, and the value a trace from before a field existed ran with
    RECORDED = {"max_batch_tokens": None, "chunk_size": None, "kv_tokens": None, "max_running": None,
                "enable_mixed": None, "trace_topk": None, "seed": None, "spec": None, "prefix_sharing": False,
                "prefix_cache": None, "kernels": None, "kv_slot_order": "fifo"}

    @classmethod
    def from_recorded(cls, engine: dict[str, Any], **overrides: Any) -> EngineArgs:
        """The arguments that rebuild a recorded run (a trace meta's `engine` entry), with `overrides`.

        A kernels="fast" trace re-runs fast; a trace from before prefix sharing ran without it, one
        from before slot restarts handed out KV slots FIFO.
        """
        kw = {k: engine[k] if k in engine else legacy for k, legacy in cls.RECORDED.items()
              if k in engine or legacy is not None}
        return cls(**{**kw, **overrides})

    def replace(self, **changes: Any) -> EngineArgs:
        """A copy with `changes`; an unknown name is a TypeError naming it."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Engine got unexpected argument(s) {', '.join(unknown)}; the engine's arguments are "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)
