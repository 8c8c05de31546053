"""The engine's configuration as one typed record (`EngineConfig`), as a trace's run metadata shows it.

Owns: `EngineConfig` (with `kernels`, the numerics mode: "exact" or the opt-in "fast") and
`CpuKernels` (which native paths ran, so a trace says it: a replay elsewhere may take the torch paths) and their JSON form, `to_dict()`, whose keys and order are the `engine`
entry of every trace's meta (the example traces in traces/ depend on it). Does not own: validating
the arguments (Engine.__init__ and the parts it builds) or the speculative config (spec/config.py).
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
