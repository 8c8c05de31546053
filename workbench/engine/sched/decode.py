"""Decode selection and preemption by recompute.

Owns: `DecodePlanner`: which running requests decode this step (those whose only token without KV
is the last sampled one), and preempting the latest admitted request while their decode slots do
not fit (its KV is freed and it waits at the head of the queue to be recomputed). Does not own:
admission and prefill (prefill.py) or releasing KV (kv.py).
"""

from __future__ import annotations

from workbench.engine.sched.batch import Preempted, ScheduleBatch
from workbench.engine.sched.kv import RequestKV
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.queues import Queues
from workbench.engine.sched.request import Req


class DecodePlanner:
    def __init__(self, queues: Queues, memory: Memory, kv: RequestKV) -> None:
        self.queues = queues
        self.memory = memory
        self.kv = kv

    def schedule(self, batch: ScheduleBatch, budget: int) -> None:
        """Fill `batch.decode` (at most `budget` rows), preempting until every decode slot fits."""
        decode = [r for r in self.queues.running if r.output_ids and r.seq_len - r.kv_len == 1]
        while decode and not self.memory.allocator.can_allocate(len(decode)):
            victim = self.preempt_latest(batch)
            decode = [r for r in decode if r is not victim]
        batch.decode = decode[:budget]

    def preempt_latest(self, batch: ScheduleBatch) -> Req:
        """Preempt the running request admitted last (recomputed later); record it in `batch`."""
        victim = max(self.queues.running, key=lambda r: r.queue_order)
        slots = self.kv.release(victim).slots
        self.queues.requeue_first(victim)
        victim.num_preemptions += 1
        batch.preempted.append(victim)
        batch.preempted_kv.append(Preempted(victim, slots))
        return victim
