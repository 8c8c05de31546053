"""What a verdict on disk is valid for: the environment parts a replacement declares it depends on.

Owns: reading each part (the CPU's model and feature flags, torch's version and build, the source
of the code that computes or checks, a model's weights, config, class and modeling code,
transformers' version) into one readable dict whose hash names the verdict file (store.py). A
different machine, a library upgrade, an edited kernel or other weights give another dict, so the
verdict is checked afresh. Does not own: the per-call part of a key (shapes, rows: the caller's).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def digest(env: dict[str, str]) -> str:
    """The environment's hash: the name of its file in the store."""
    return sha(json.dumps(env, sort_keys=True).encode())


def source_sha(obj: Any) -> str:
    """The source file defining `obj` (a class, function or module), hashed; "" where it has none."""
    try:
        path = inspect.getsourcefile(obj)
        return sha(Path(path).read_bytes()) if path else ""
    except (OSError, TypeError):
        return ""


def code_sha(modules: tuple[str, ...]) -> str:
    """The source of the named modules, hashed together (imported by name: nothing here imports them)."""
    return sha(b"".join(Path(inspect.getsourcefile(importlib.import_module(m))).read_bytes() for m in modules))


def _cpu() -> tuple[str, str]:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; platform strings elsewhere)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    return model, flags


# Variables that change which instructions torch's, MKL's, oneDNN's or the C kernels' own code runs
# on the same CPU, so which bits a replacement must match: ATen's dispatch (its AVX2 build on an
# AVX512 CPU), MKL's code path and reproducibility mode, oneDNN's instruction cap, and extra flags
# for the C kernels' build (native.py; `-mno-avx512f` builds what an AVX2-only CPU gets)
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE",
                 "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "WORKBENCH_NATIVE_FLAGS")

_machine: dict[str, str] | None = None


def isa_settings() -> str:
    """The `ISA_VARIABLES` this process has set, as `NAME=value` words ('' where none)."""
    return " ".join(f"{n}={os.environ[n]}" for n in ISA_VARIABLES if os.environ.get(n))


def machine() -> dict[str, str]:
    """The CPU (model, feature flags), the instruction set ATen dispatches to and the variables that
    narrow MKL's or the C kernels' (`ISA_VARIABLES`), and torch's version and build (MKL's version is
    in it)."""
    global _machine
    if _machine is None or _machine["torch"] != _torch_version() or _machine["isa_settings"] != isa_settings():
        import torch

        model, flags = _cpu()
        _machine = {"cpu": model, "cpu_flags_sha256": sha(flags.encode()), "torch": torch.__version__,
                    "torch_build_sha256": sha(torch.__config__.show().encode()),
                    "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa_settings": isa_settings()}
    return _machine


def _torch_version() -> str:
    import torch

    return torch.__version__


def model(m: Any, content_hash: str) -> dict[str, str]:
    """A loaded model as the code that reads its structure sees it: the folder's content hash, the
    whole config, the class and the source of the module defining it, transformers' and torch's versions."""
    import torch
    import transformers

    cls = type(m)
    return {"model_hash": content_hash,
            "config_sha256": sha(m.config.to_json_string(use_diff=False).encode()),
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "modeling_sha256": source_sha(sys.modules.get(cls.__module__) or cls),
            "transformers": transformers.__version__, "torch": torch.__version__}
