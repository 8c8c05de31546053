"""Each model's attention variants kept on disk, so a warm load runs no probe forward.

Owns: the key a probe's result is valid for, the JSON file `<cache>/variants/<key>.json` (the model
cache, `WORKBENCH_CACHE`, default `~/.cache/workbench`), reading it defensively and writing it
atomically. Does not own the probe itself or the refusals (variants.py): only a model the probe
accepted is written, so a refused model is probed, and refused, on every load.

What a layer passes its attention function (variants.py) is decided by the model's code and its
config, not by its weights. The key holds all of them: the model folder's content hash
(loader.folder_hash), the whole config as JSON, the model class and the source of the module that
defines it, transformers' and torch's versions, and the source of variants.py and of this file. A
new transformers, an edited config or modeling file, other weights or a change to the probe starts
a new file and probes afresh. What the key cannot see is a model changed in memory after loading
(a monkeypatched layer): code that does that calls `variants.probe` itself, or sets
`WORKBENCH_PROBE_CACHE=0`, which probes on every load.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workbench.engine.run.variants import AttentionVariant, probe

ENV_SWITCH = "WORKBENCH_PROBE_CACHE"
PROBED_NOW = "probed in this process"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def source_sha(obj: Any) -> str:
    """The source file defining `obj` (a class or module), hashed; "" where it has none."""
    try:
        path = inspect.getsourcefile(obj)
        return _sha(Path(path).read_bytes()) if path else ""
    except (OSError, TypeError):
        return ""


def environment(model: Any, content_hash: str) -> dict[str, str]:
    """What one probe result is valid for (the file's key is its hash)."""
    import torch
    import transformers

    cls = type(model)
    return {"model_hash": content_hash,
            "config_sha256": _sha(model.config.to_json_string(use_diff=False).encode()),
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "modeling_sha256": source_sha(sys.modules.get(cls.__module__) or cls),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "probe_code_sha256": _sha(b"".join(Path(f).read_bytes() for f in (
                inspect.getsourcefile(probe), __file__)))}


def _valid(entry: Any, index: int) -> bool:
    """One layer's record as `write` stores it (anything else means the file is not ours: re-probe)."""
    if not isinstance(entry, dict) or set(entry) != {"layer", "window", "softcap", "sinks", "scaling"}:
        return False
    window, softcap, scaling = entry["window"], entry["softcap"], entry["scaling"]
    return (entry["layer"] == index and type(entry["layer"]) is int
            and (window is None or (type(window) is int and window >= 1))
            and (softcap is None or type(softcap) is float)
            and type(entry["sinks"]) is bool and type(scaling) is float)


class VariantStore:
    """Probe results on disk, one file per key: `get` (with the date it was probed), `put`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, env: dict[str, str]) -> Path:
        return self.folder / f"{_sha(json.dumps(env, sort_keys=True).encode())}.json"

    def get(self, env: dict[str, str], num_layers: int) -> tuple[list[AttentionVariant], str] | None:
        """The variants stored for `env` and when they were probed, or None (no file, or not a valid one)."""
        try:
            data = json.loads(self.path(env).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("environment") != env:
            return None
        layers, probed_at = data.get("layers"), data.get("probed_at")
        if (not isinstance(layers, list) or len(layers) != num_layers or not isinstance(probed_at, str)
                or not all(_valid(e, i) for i, e in enumerate(layers))):
            return None
        return [AttentionVariant(**e) for e in layers], probed_at

    def put(self, env: dict[str, str], found: list[AttentionVariant]) -> None:
        """Keep one probe's result (best effort: an unwritable cache only means the next load probes)."""
        write_json(self.path(env), {"environment": env, "probed_at": now_utc(),
                                    "layers": [v.as_dict() for v in found]})


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` to `path` atomically, best effort (an unwritable cache is not an error)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def default_store() -> VariantStore | None:
    """The store beside the model cache; None with `WORKBENCH_PROBE_CACHE=0`."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    from workbench.models.loader import cache_root

    return VariantStore(cache_root() / "variants")


def variants_for(model: Any, content_hash: str, store: VariantStore | None = None) -> tuple[list[AttentionVariant], str]:
    """Each layer's variant and where it came from (`PROBED_NOW` or "cached probe from <date>"): from
    the store when it holds this exact model, code and library versions, else by `variants.probe`
    (whose ValueError refuses the model), then stored. A cached result leaves the model's attention
    implementation as it was; a probe leaves it on the probe: the caller sets its own next."""
    store = store if store is not None else default_store()
    if store is None:
        return probe(model), PROBED_NOW
    env = environment(model, content_hash)
    layers = int(getattr(model.config, "num_hidden_layers", -1))
    cached = store.get(env, layers)
    if cached is not None:
        return cached[0], f"cached probe from {cached[1]}"
    found = probe(model)
    store.put(env, found)
    return found, PROBED_NOW
