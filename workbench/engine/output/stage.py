"""The output stage: sampled tokens in, `StepOutput`s and finished `RequestOutput`s out.

Owns: the tail of every step, plain or speculative: appending a step's final tokens to their
requests (`append`), sending each new token through the detokenizer and the finish checks, cutting
a multi-token run at the token that finishes it, accounting the step's time per request
(`process`), and ending requests (`finish`: finish reason, KV release through the callback the
engine gives, the final output). Does not own: the rules (postprocess.py, finish.py,
detokenizer.py) or what releasing KV means (the scheduler's, called through `release`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.engine.output.finish import FinishResult
from workbench.engine.output.output import Finished, RequestOutput, StepOutput
from workbench.engine.output.postprocess import OutputProcessor
from workbench.engine.sched.batch import Released
from workbench.engine.sched.request import Req, ReqStatus
from workbench.engine.step import StepContext


@dataclass(frozen=True, slots=True)
class NewTokens:
    """The tokens a step appended to one request (one for plain decoding, several for speculation)."""

    req: Req
    token_ids: list[int]


class OutputStage:
    def __init__(self, processor: OutputProcessor, release: Callable[[Req, str], Released]) -> None:
        self.processor = processor
        self.release = release  # takes a finished request out of the scheduler (and the drafter)
        self.finished: dict[str, RequestOutput] = {}

    def append(self, ctx: StepContext, reqs: list[Req], sample: Any) -> None:
        """Append one sampled row per request (`sample`: SamplerOutput or the speculative tokens,
        rows in `reqs` order). The step's tokens are final from here on."""
        self.processor.append_tokens(reqs, sample, ctx.step)

    def finish_index(self, req: Req, tokens: list[int]) -> int:
        """How many of a proposed multi-token run `req` may append before a finish rule ends it."""
        return self.processor.finish_index(req, tokens)

    def process(self, ctx: StepContext, new: list[NewTokens]) -> list[StepOutput]:
        """Detokenize, decide finish, release finished requests.

        The new tokens are already appended to each request's output; they go through the checks one
        at a time, and a finish on one of them drops the ones after it (speculative runs).
        """
        # one token a request (plain decoding): the trace gets every request's detok, then finish,
        # then step stamp, kind by kind (one row each in a trace file); a speculative run's tokens
        # keep their detok, finish, detok, ... order
        single = all(len(item.token_ids) == 1 for item in new)
        with ctx.obs.by_kind(("detok", "finish", "stamp")) if single else contextlib.nullcontext():
            return self._process(ctx, new)

    def _process(self, ctx: StepContext, new: list[NewTokens]) -> list[StepOutput]:
        results = []
        for item in new:
            req = item.req
            first = len(req.output_ids) - len(item.token_ids) + 1
            delta, kept, final = [], [], None
            for n in range(first, len(req.output_ids) + 1):
                detok, decision = self.processor.process_token(req, n)
                kept.append(req.output_ids[n - 1])
                delta.append(detok.delta)
                ctx.obs.output_processed(ctx, req, req.output_ids[n - 1], detok, decision)
                if decision.finish_reason is not None:
                    self.processor.truncate(req, n)
                    final = decision
                    break
            stamps = req.timing.account_step(ctx.clock, time.perf_counter())
            ctx.obs.stamped(ctx, req.req_id, "step", stamps)
            done = self.finish(ctx, req, final) if final is not None else None
            text = "".join(delta) + (done.tail if done is not None else "")
            results.append(StepOutput(req.req_id, kept, text, done is not None,
                                      done.output if done is not None else None,
                                      self.processor.step_logprobs(req, kept)))
        return results

    def finish(self, ctx: StepContext, req: Req, result: FinishResult) -> Finished:
        """End `req` with `result`'s reason and evidence: release its KV, build its final output."""
        reason = result.finish_reason
        req.finish_reason, req.evidence, req.matched_stop = reason, result.evidence, result.matched_stop
        req.status = ReqStatus.FINISHED
        released = self.release(req, reason)
        done = self.processor.make_output(req)
        self.finished[req.req_id] = done.output
        ctx.obs.finished(ctx, req, done.output, released, reason)
        return done

    def finish_scored(self, ctx: StepContext, reqs: list[Req]) -> list[StepOutput]:
        """Requests with max_new_tokens=0 (prompt scoring) finish when their prefill completes."""
        length = FinishResult("length", {"type": "length", "length": 0, "cause": "max_new_tokens"})
        return [self.finish(ctx, req, length).step_output() for req in reqs
                if req.params.max_new_tokens == 0 and not req.finished]
