"""The scheduler's two queues: requests waiting for admission and requests running.

Owns: `Queues` (the waiting deque, first come first served, and the running list) and moving a
request between them. Shared by the scheduler's parts (scheduler.py, prefill.py, decode.py,
sharing.py), which decide when a request moves.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from workbench.engine.sched.request import Req, ReqStatus


@dataclass(slots=True)
class Queues:
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        req.queue_order = next(self._order)
        self.waiting.append(req)

    def start(self, req: Req) -> None:
        """A waiting request was admitted (it holds a request slot now)."""
        self.waiting.remove(req)
        self.running.append(req)
        req.status = ReqStatus.RUNNING

    def requeue_first(self, req: Req) -> None:
        """A preempted request waits again, ahead of everyone."""
        if req in self.running:
            self.running.remove(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)

    def drop(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
