"""Bounded, fair admission: how a request's prompts get into the engine without stalling other clients.

Owns: `AdmissionLimits` (prompts per request and the total tokens one request may ask for,
prompts x n x max_tokens, each refused naming its `workbench serve` flag), and `Admitter`, the one
thread that calls `engine.add_request`. Every HTTP request is a `Job`; the thread takes one
prompt at a time from the jobs in turn (round robin), and a job holds at most `window` unfinished
requests in the engine (a quarter of the engine's running slots by default), so a 5,000-prompt
request is fed in as its requests finish, the engine's steps stay as short as a quarter-full batch,
and a small request that arrives meanwhile is admitted at the next turn and finds running slots free. A cancelled job (its client left, the server stops) stops being admitted at once.
Does not own: the handles outputs arrive in or aborting admitted requests (engine_loop.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from workbench.engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What one request may ask for; 0 means no limit."""

    max_prompts: int = 2048  # prompts in one /v1/completions request (OpenAI's batch limit)
    max_tokens: int = 1 << 20  # prompts x n x max_tokens of one request
    max_running: int = 0  # unfinished requests one request may hold in the engine (0: a quarter of max_running)

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_tokens", "max_running"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: the default), got {value!r}")

    def window(self, engine_max_running: int) -> int:
        """How many unfinished requests one HTTP request may hold in the engine at once: small enough
        that the engine's steps stay short for everyone else while a bulk request runs."""
        return self.max_running or max(1, engine_max_running // 4)

    def check(self, num_prompts: int, n: int, max_tokens: int) -> None:
        """ValueError naming the limit (and the flag that raises it) when a request asks for too much."""
        if self.max_prompts and num_prompts > self.max_prompts:
            raise ValueError(f"prompt: {num_prompts} prompts in one request exceed the limit of {self.max_prompts} "
                             f"(workbench serve --max-prompts-per-request)")
        total = num_prompts * n * max_tokens
        if self.max_tokens and total > self.max_tokens:
            raise ValueError(f"max_tokens: this request asks for up to {total} tokens ({num_prompts} prompts x n={n} "
                             f"x max_tokens={max_tokens}), above the limit of {self.max_tokens} per request "
                             f"(workbench serve --max-request-tokens)")


@dataclass(slots=True)
class Job:
    """One request's prompts on their way into the engine."""

    prompts: list[Any]
    bases: list[str]
    params: SamplingParams
    owner: Any = None  # a weak reference to the handle its outputs go to (engine_loop.py)
    first: Future = field(default_factory=Future)  # set once the first window is in (or it failed)
    next: int = 0  # index of the next prompt to add
    in_engine: int = 0  # admitted requests that have not finished
    admitted: list[str] = field(default_factory=list)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def remaining(self) -> int:
        return len(self.prompts) - self.next


class Admitter:
    """The admission thread: round robin over jobs, one prompt per turn, each job under its window."""

    def __init__(self, engine: Any, window: int, on_failed: Callable[[Job, str], None]) -> None:
        self.engine = engine
        self.window = max(1, window)
        self.on_failed = on_failed  # a prompt after the first window was refused (admission thread)
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="workbench-admit", daemon=True)
        self._thread.start()

    @property
    def pending_prompts(self) -> int:
        return sum(j.remaining for j in self._jobs)

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._stopped:
                raise RuntimeError("admission has stopped")
            self._jobs.append(job)
            self._cond.notify()
        return job.first

    def cancel(self, job: Job) -> list[str]:
        """Stop admitting `job`; the ids admitted so far (the caller aborts them)."""
        with job.lock:
            job.cancelled = True
            admitted = list(job.admitted)
        with self._cond:
            self._cond.notify()
        return admitted

    def finished(self, job: Job, count: int = 1) -> None:
        """`count` of the job's requests finished: room for more of its prompts."""
        with self._cond:
            job.in_engine -= count
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for job in self._jobs:
                job.cancelled = True
            self._cond.notify()

    # --- the admission thread ----------------------------------------------------------------

    def _ready(self, job: Job) -> bool:
        need = job.params.n
        return job.in_engine == 0 or job.in_engine + need <= self.window

    def _pick(self) -> Job | None:
        """The next job in turn that may add a prompt; finished and cancelled jobs leave the queue."""
        for _ in range(len(self._jobs)):
            job = self._jobs[0]
            if job.cancelled or job.remaining == 0:
                self._jobs.popleft()
                self._settle(job)
                continue
            self._jobs.rotate(-1)
            if self._ready(job):
                return job
            self._settle(job)  # waiting on its window: what got in so far is its first answer
        return None

    @staticmethod
    def _settle(job: Job) -> None:
        if not job.first.done() and job.next > 0:
            job.first.set_result(None)
        elif not job.first.done() and job.cancelled:
            job.first.set_result(None)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._pick()
                while job is None and not self._stopped:
                    self._cond.wait()
                    job = self._pick()
                if job is None:
                    return
                index = job.next
                job.next += 1
                job.in_engine += job.params.n
            self._add(job, index)

    def _add(self, job: Job, index: int) -> None:
        try:
            ids = self.engine.add_request(job.prompts[index], job.params, req_id=job.bases[index])
        except BaseException as exc:
            with self._cond:
                job.in_engine -= job.params.n
            with job.lock:
                job.cancelled = True
            if not job.first.done():
                job.first.set_exception(exc)
            else:  # the response has started: the request ends with an error naming the prompt
                self.on_failed(job, f"prompt {index}: {exc}")
            return
        with job.lock:
            job.admitted += ids
            cancelled = job.cancelled
        if cancelled:  # the client left while this prompt was being added
            for rid in ids:
                self.engine.abort(rid, "client disconnected")
        if job.remaining == 0 and not job.first.done():
            job.first.set_result(None)
