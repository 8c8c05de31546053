"""The verdicts of this process: decided once, kept where the replacement says, reported in one section.

Owns: `Book.decide` (the verdict for a replacement and a key: from the process's tables, else from
the store, else by running the check now, then kept), the tables (one per replacement for the
process, one per object for verdicts about one model object, which go with the object), and
`Book.report()`, the `checks` section of `ModelRunner.kernel_report()` and of every trace's engine
config. `BOOK` is the process's book, which every kernel and check uses by default; a fresh
`Book()` keeps nothing on disk (tests). Does not own: any check (each lives with its kernel).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from workbench.engine.kernels import environment, switch
from workbench.engine.kernels.registry import REGISTRY
from workbench.engine.kernels.store import Store
from workbench.engine.kernels.verdict import PER_OBJECT, PROCESS, Replacement, Verdict

DEFAULT = "default"  # the store under the cache root, unless the switch says `fresh`
_NONE: dict = {}  # an empty table to look up in (never written)


def label(rep: Replacement, key: tuple) -> str:
    """A key as the store and the report name it: `out_features=576 in_features=1536 ...`."""
    return " ".join(f"{n}={v}" for n, v in zip(rep.key, key, strict=True))


class Book:
    def __init__(self, store: Store | None | str = None) -> None:
        self._store = store  # a Store, None (nothing on disk) or DEFAULT
        self._default: Store | None = None
        self.tables: dict[str, dict[tuple, Verdict]] = {n: {} for n, r in REGISTRY.items() if r.lives == PROCESS}
        self.objects: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple], Verdict]] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    @property
    def store(self) -> Store | None:
        """Where verdicts are kept between processes (None: nowhere)."""
        if self._store != DEFAULT:
            return self._store
        if switch.fresh():
            return None
        here = Store()
        if self._default is None or self._default.folder != here.folder:  # WORKBENCH_CACHE moved
            self._default = here
        return self._default

    def environment(self, rep: Replacement) -> dict[str, str]:
        """The parts of the machine a replacement's verdicts on disk depend on (see its `depends_on`)."""
        return {**environment.machine(), "code_sha256": environment.code_sha(rep.code)}

    def decide(self, name: str, key: tuple, check: Callable[[], Verdict], *, about: Any = None,
               env: Callable[[], dict[str, str]] | None = None,
               valid: Callable[[Verdict], bool] | None = None) -> Verdict:
        """The verdict on replacement `name` for `key`: kept in this process, else kept on disk by an
        earlier one (`env()` its environment, default the machine and the replacement's code; None:
        none is known, so nothing is read or kept on disk; `valid` whether such a verdict still
        applies), else `check()` now. `about`: the object the verdict is
        about, for a replacement that lives per object or per load (a model)."""
        verdict = self.tables.get(name, _NONE).get(key)  # the per-call path: one lookup
        if verdict is not None:
            return verdict
        rep = REGISTRY[name]
        if switch.refused(name):  # kept like any verdict (the report shows it), never on disk
            verdict = Verdict(False, f"switched off ({switch.VARIABLE} has -{name})", {})
        else:
            verdict = self._decide(name, rep, key, check, about, env, valid)
        with self.lock:
            if rep.lives == PROCESS:
                self.tables[name][key] = verdict
            elif about is not None:  # per object: read back; per load: for the report only
                self.objects.setdefault(about, {})[(name, key)] = verdict
        return verdict

    def _decide(self, name: str, rep: Replacement, key: tuple, check: Callable[[], Verdict], about: Any,
                env: Callable[[], dict[str, str]] | None, valid: Callable[[Verdict], bool] | None) -> Verdict:
        """The verdict not yet kept in this process: a per-object one, the store's, or `check()` now."""
        verdict = None
        if rep.lives == PER_OBJECT and about is not None:
            verdict = self.objects.get(about, _NONE).get((name, key))
            if verdict is not None:
                return verdict
        store = self.store if rep.on_disk != "none" else None
        environ = None
        if store is not None:
            environ = env() if env is not None else self.environment(rep)
            if environ is None:  # the caller knows no environment this verdict holds in: this process only
                store = None
        if store is not None:
            verdict = store.get(name, environ, label(rep, key))
            if verdict is not None and valid is not None and not valid(verdict):
                verdict = None
        if verdict is None:
            verdict = check()
            if store is not None and (verdict.ok or rep.on_disk == "all"):
                store.put(name, environ, label(rep, key), verdict)
        return verdict

    def verdicts(self, name: str, about: Any = None) -> list[tuple[tuple, Verdict]]:
        """Replacement `name`'s verdicts so far, by key (per-object ones: those about `about`)."""
        if REGISTRY[name].lives != PROCESS:
            mine = self.objects.get(about, {}) if about is not None else {}
            return sorted(((k, v) for (n, k), v in mine.items() if n == name), key=lambda kv: kv[0])
        return sorted(self.tables[name].items(), key=lambda kv: kv[0])

    def report(self, about: Any = None, state: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The one section: the switch, the store, and per registered replacement what it is and its
        verdicts so far (`about`: the model whose per-model verdicts to show; `state`: what a
        replacement's user adds about it now, e.g. how many forwards the direct forward ran)."""
        store = self.store
        out: dict[str, Any] = {"switch": switch.describe(),
                               "store": str(store.folder) if store is not None else None, "replacements": {}}
        for name, rep in REGISTRY.items():
            entry = {**rep.describe(), "verdicts": [
                {"key": dict(zip(rep.key, k, strict=True)), **v.as_dict()} for k, v in self.verdicts(name, about)]}
            if state and name in state:
                entry["state"] = state[name]
            out["replacements"][name] = entry
        return out


def model_environment(name: str, model: Any, content_hash: str) -> dict[str, str]:
    """What a verdict about a model (the probe's, the direct forward's) is valid for: the model as
    environment.model sees it, and the replacement's code."""
    return {**environment.model(model, content_hash), "code_sha256": environment.code_sha(REGISTRY[name].code)}


BOOK = Book(DEFAULT)  # this process's verdicts (the default of every kernel and check)
