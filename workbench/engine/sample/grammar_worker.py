"""The grammar worker: a child process that tries a constraint's compile under a time and memory budget.

Owns: `GrammarWorkers`, the parent's pool of child processes (`python -m
workbench.engine.sample.grammar_worker`, started by `prestart` as a server starts, else on the first
constrained request) and their
verdicts. A constraint is first compiled in a worker, against the engine's tokenizer (sent to the
child once, serialised), with `jsonschema`'s check of a JSON schema before it. The parent waits at
most `compile_timeout` seconds and kills the worker past it, or once the worker's resident memory
grew by `compile_memory_mb` (the child also caps its address space, `RLIMIT_AS`, at that much
above where it started), so a compile that never ends, or eats the machine, costs one dead child
and its memory comes back whole. The verdict (`ok`, or the message naming the limit) is cached by
the grammar's key: the same hostile schema sent again is refused at once. Only a constraint the
worker compiled within budget is compiled again in the engine's process (grammar.py); xgrammar
can serialise a compiled grammar, but its JSON is ~100x the grammar's memory (357 MB for a
4 MB grammar of 1,000 properties), so the verdict is what crosses the process boundary.

A waiter that gives up (`abandon`, a client that disconnected) kills the compile when nobody else
waits on it. The child refuses to open files or sockets once started (an audit hook), so nothing a
schema names is ever fetched. Does not own: the structural limits checked before (grammar_limits.py)
or the engine-side cache (grammar.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from workbench.engine.sample.grammar_limits import FLAGS, GrammarLimits

START_TIMEOUT = 180.0  # seconds a worker may take to import xgrammar and take the tokenizer
VERDICTS_KEPT = 4096
RESULT_CHARS_KEPT = 32 << 20  # what the kept verdicts' results (a forced tool call's EBNF) may hold together
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_HEADER = struct.Struct("!I")


def clean_error(exc: BaseException) -> str:
    """xgrammar's C++ message without its timestamp, source path and assertion text."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", first)


def grammar_key(kind: str, text: str) -> str:
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class CompileOutcome:
    """What the worker said about one constraint."""

    ok: bool
    message: str = ""  # why not, naming the parameter and the limit
    seconds: float = 0.0  # the compile's time in the worker
    peak_mb: float = 0.0  # the worker's memory growth while compiling
    cache: bool = True  # False for a verdict that says nothing about the grammar (cancelled, no worker)
    result: str | None = None  # what a "wrapped" job built (an EBNF grammar; kept when under 512 KB)


# --- framing (both sides) -----------------------------------------------------------------------


def _write(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _read(fd: int) -> dict | None:
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


# --- the parent's side ----------------------------------------------------------------------------


class _Proc:
    """One worker process."""

    def __init__(self, init: Callable[[], dict], memory_mb: int) -> None:
        self.started_at = time.time()  # wall clock: what a client's request time is compared with
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.engine.sample.grammar_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)  # a ^C at the terminal reaches the server, which stops it
        self.memory_mb = memory_mb
        try:  # the child imports xgrammar meanwhile (seconds)
            _write(self.proc.stdin.fileno(), {**init(), "memory_mb": memory_mb})
        except BaseException:
            self.kill()
            raise
        ready = self._wait(START_TIMEOUT, None)
        if not ready or not ready.get("ready"):
            self.kill()
            raise RuntimeError("the grammar worker did not start")
        self.base_mb = _rss_mb(self.proc.pid)
        self.ready_at = time.time()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def _wait(self, timeout: float, peak: list[float] | None) -> dict | None:
        """The next reply within `timeout` s; None on timeout, death, or memory over the budget."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.02))
            if ready:
                return _read(fd)
            if peak is not None:
                grown = _rss_mb(self.proc.pid) - self.base_mb
                peak[0] = max(peak[0], grown)
                if grown > self.memory_mb:
                    return None

    def run(self, job: dict, timeout: float) -> tuple[dict | None, float]:
        self.base_mb = _rss_mb(self.proc.pid)
        _write(self.proc.stdin.fileno(), job)
        peak = [0.0]
        return self._wait(timeout, peak), peak[0]


class _Job:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.verdict: CompileOutcome | None = None
        self.waiters = 1
        self.proc: _Proc | None = None
        self.cancelled = False


class GrammarWorkers:
    """Compile verdicts from worker processes, cached by the grammar's key; thread-safe."""

    def __init__(self, tokenizer_info: Callable[[], str], limits: GrammarLimits) -> None:
        self._tokenizer_info = tokenizer_info  # the serialised xgrammar TokenizerInfo, asked for once
        self._init: dict | None = None
        self.limits = limits
        self._lock = threading.Lock()
        self._slots: list[_Proc | None] = [None] * limits.workers
        self._free = threading.Semaphore(limits.workers)
        self._verdicts: OrderedDict[str, CompileOutcome] = OrderedDict()
        self._result_chars = 0  # the kept verdicts' results, bounded by RESULT_CHARS_KEPT
        self._inflight: dict[str, _Job] = {}
        self._closed = False
        self.starts: list[tuple[float, float]] = []  # (started, ready) wall-clock times of each worker process
        self.runs: Counter[str] = Counter()  # jobs sent to a worker, by kind

    def prestart(self) -> None:
        """Start every worker process now (blocking; a server calls it on a thread at start-up), so the
        first constrained request does not wait seconds for one to import xgrammar. Slots in use or
        already started are left alone."""
        taken: list[tuple[int, _Proc]] = []
        try:
            for _ in range(self.limits.workers):
                if not self._free.acquire(blocking=False):
                    break
                try:
                    taken.append(self._take())
                except BaseException:
                    self._free.release()
                    raise
        finally:
            for slot, proc in taken:
                self._give(slot, proc, recycle=False)
                self._free.release()

    def status(self) -> dict:
        """Worker processes started, when the newest became ready (wall clock), and jobs run by kind."""
        with self._lock:
            return {"workers_started": len(self.starts), "worker_ready_at": self.starts[-1][1] if self.starts else None,
                    "worker_runs": dict(self.runs)}

    def cached(self, key: str) -> CompileOutcome | None:
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
            return verdict

    def verdict(self, kind: str, text: str, key: str, param: str, extra: dict | None = None) -> CompileOutcome:
        """Compile `text` in a worker within the budget (blocking); the same key is compiled once.
        Kinds: json_schema, regex, ebnf (compile), schema (jsonschema's check only), wrapped (the EBNF
        of a JSON schema between two regexes, `extra` = {"head", "tail"}: in `result`, not cached)."""
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            job = self._inflight.get(key)
            if job is not None:
                job.waiters += 1
                owner = False
            else:
                job = self._inflight[key] = _Job()
                owner = True
        if not owner:
            job.done.wait()
            return job.verdict
        try:
            verdict = self._run(job, kind, text, param, extra or {})
        except Exception as exc:  # no worker could start: nothing is known about the grammar
            verdict = CompileOutcome(False, f"{param}: the grammar worker failed ({exc})", cache=False)
        with self._lock:
            job.verdict = verdict
            self._inflight.pop(key, None)
            if verdict.cache:  # a forced tool call's EBNF too: the same tools are not parsed again per request
                self._verdicts[key] = verdict
                self._result_chars += len(verdict.result or "")
                while len(self._verdicts) > VERDICTS_KEPT or self._result_chars > RESULT_CHARS_KEPT:
                    self._result_chars -= len(self._verdicts.popitem(last=False)[1].result or "")
        job.done.set()
        return verdict

    def abandon(self, key: str) -> None:
        """A waiter left: when it was the last one, the compile is killed (its worker restarts)."""
        with self._lock:
            job = self._inflight.get(key)
            if job is None:
                return
            job.waiters -= 1
            if job.waiters > 0:
                return
            job.cancelled = True  # not started yet: it will not start
            proc = job.proc
        if proc is not None:
            proc.proc.send_signal(signal.SIGKILL)

    def _run(self, job: _Job, kind: str, text: str, param: str, extra: dict) -> CompileOutcome:
        lim = self.limits
        self._free.acquire()
        try:
            slot, proc = self._take()
            with self._lock:
                job.proc = proc
                cancelled = job.cancelled
            if cancelled:
                self._give(slot, proc, recycle=False)
                return CompileOutcome(False, f"{param}: cancelled", cache=False)
            with self._lock:
                self.runs[kind] += 1
            t0 = time.perf_counter()
            reply, peak = proc.run({**extra, "kind": kind, "text": text}, lim.compile_timeout)
            seconds = time.perf_counter() - t0
            if reply is not None:
                self._give(slot, proc, recycle=_rss_mb(proc.proc.pid) - proc.base_mb > 64)
                if reply.get("ok"):
                    result = reply.get("result")
                    return CompileOutcome(True, seconds=seconds, peak_mb=peak, result=result,
                                          cache=result is None or len(result) <= RESULT_CHARS_KEPT // 64)
                if reply.get("error") == "memory":
                    return self._memory(param, kind, seconds, peak)
                return CompileOutcome(False, f"{param} is invalid: {reply.get('error', 'unknown error')}", seconds, peak)
            self._give(slot, proc, recycle=True)  # killed, dead or over budget: a fresh one next time
            if job.cancelled:
                return CompileOutcome(False, f"{param}: cancelled", cache=False)
            if peak > lim.compile_memory_mb or proc.proc.returncode not in (None, -signal.SIGKILL):
                return self._memory(param, kind, seconds, peak)
            return CompileOutcome(False, f"{param}: compiling this {_what(kind)} took longer than the limit of "
                                  f"{lim.compile_timeout:g} s (workbench serve {FLAGS['compile_timeout']})",
                           seconds, peak)
        finally:
            self._free.release()

    def _memory(self, param: str, kind: str, seconds: float, peak: float) -> CompileOutcome:
        return CompileOutcome(False, f"{param}: compiling this {_what(kind)} needed more than the limit of "
                              f"{self.limits.compile_memory_mb} MB of memory (workbench serve "
                              f"{FLAGS['compile_memory_mb']})", seconds, peak)

    def _take(self) -> tuple[int, _Proc]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar workers are closed")
            slot = next(i for i, p in enumerate(self._slots) if p is not False)
            proc = self._slots[slot]
            self._slots[slot] = False  # in use
        if proc is None or not proc.alive:
            try:
                proc = _Proc(self._init_message, self.limits.compile_memory_mb)
            except BaseException:
                with self._lock:
                    self._slots[slot] = None
                raise
            with self._lock:
                self.starts.append((proc.started_at, proc.ready_at))
        return slot, proc

    def _init_message(self) -> dict:
        if self._init is None:
            self._init = {"tokenizer_info": self._tokenizer_info()}
        return self._init

    def _give(self, slot: int, proc: _Proc, recycle: bool) -> None:
        if recycle or self._closed:
            proc.kill()
            proc = None
        with self._lock:
            self._slots[slot] = proc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs = [p for p in self._slots if p]
            for job in self._inflight.values():
                if job.proc is not None:
                    procs.append(job.proc)
        for proc in procs:
            proc.kill()

    def pids(self) -> list[int]:
        """The worker processes alive now (tests, memory reports)."""
        with self._lock:
            return [p.proc.pid for p in self._slots if p and p.alive]


def _what(kind: str) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar", "schema": "JSON schema",
            "wrapped": "tool call schema"}.get(kind, kind)


# --- the child's side -----------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _refuse_outside_access() -> None:
    """From here on this process opens no file and no socket: a schema naming one gets an error."""
    blocked = ("open", "socket.connect", "socket.getaddrinfo", "socket.bind", "urllib.Request",
               "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn")

    def hook(event: str, args: tuple) -> None:
        if event in blocked:
            raise PermissionError(f"the grammar worker does not {event} ({str(args[:1])[:80]})")

    sys.addaudithook(hook)


def wrapped_grammar(schema_json: str, head_regex: str, tail_regex: str) -> str:
    """EBNF of the JSON schema's output between `head_regex` and `tail_regex` (a tool call's tags)."""
    import xgrammar as xgr

    parts = [xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)]
    parts = [xgr.Grammar.from_regex(head_regex)] * bool(head_regex) + parts + \
        [xgr.Grammar.from_regex(tail_regex)] * bool(tail_regex)
    return str(xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0])


def _job(job: dict, compiler: object) -> str | None:
    kind, text = job["kind"], job["text"]
    if kind == "wrapped":
        return wrapped_grammar(text, job.get("head", ""), job.get("tail", ""))
    if kind in ("json_schema", "schema"):
        import jsonschema

        schema = json.loads(text)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise ValueError(f"not a valid JSON schema at {where}: {exc.message[:200]}") from None
        if kind == "schema":
            return None
        compiler.compile_json_schema(text, any_whitespace=False)
    elif kind == "regex":
        compiler.compile_regex(text)
    else:
        compiler.compile_grammar(text)
    return None


def _child() -> int:
    import resource

    rfd, wfd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
    init = _read(rfd)
    if init is None:
        return 1
    os.nice(10)  # the engine's threads win the CPU over a compile
    import jsonschema
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init.pop("tokenizer_info"))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler.compile_regex("a")  # warm what a first compile loads
    warm = {"$id": "urn:warm", "$defs": {"a": {"type": "string", "pattern": "^a$", "format": "date"}},
            "$ref": "#/$defs/a"}
    for name in ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator",
                 "Draft201909Validator", "Draft202012Validator"):
        cls = getattr(jsonschema, name, None)
        if cls is not None:  # metaschemas and format checkers load lazily: load them all now
            cls.check_schema(warm)
    parent = os.getppid()

    def orphaned() -> None:  # the server died mid-compile: stop, do not finish a hostile compile alone
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    limit = _vm_size() + (int(init["memory_mb"]) + 256) * (1 << 20)
    _refuse_outside_access()
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    _write(wfd, {"ready": True})
    while True:
        job = _read(rfd)
        if job is None:
            return 0
        try:
            result = _job(job, compiler)
            reply = {"ok": True} if result is None else {"ok": True, "result": result}
        except MemoryError:
            reply = {"ok": False, "error": "memory"}
        except Exception as exc:  # xgrammar raises RuntimeError and friends from C++
            reply = {"ok": False, "error": clean_error(exc)[:300]}
        _write(wfd, reply)


if __name__ == "__main__":
    try:
        code = _child()
    except BrokenPipeError:  # the server closed its end first (it shut down while this worker warmed up)
        code = 0  # nobody is left to answer, and a traceback in the server's log would be noise
    for stream in (sys.stdout, sys.stderr):  # fd 1 is stderr now: stray prints end up in the log
        try:
            stream.flush()
        except OSError:
            pass
    os._exit(code)  # not sys.exit: the exit's flush of the frame pipe would raise again
