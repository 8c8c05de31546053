"""Output processing: appending sampled tokens, detokenizing, deciding finish, building outputs.

Owns: the per-request glue of the pipeline's tail — `append_tokens` (ids, logprobs, timings),
`detokenize` (the request's IncrementalDetokenizer), `decide_finish` (finish.py's ordered checks
with this request's inputs) and `make_output` (`RequestOutput`). Does not own: the rules
themselves (detokenizer.py, finish.py, tool_parser.py) or tracing (engine.py emits).
"""

from __future__ import annotations

import time
from typing import Any

from workbench.engine.detokenizer import DetokUpdate, IncrementalDetokenizer
from workbench.engine.finish import FinishInputs, FinishResult, decide_finish
from workbench.engine.output import RequestOutput, TokenLogprob
from workbench.engine.request import Req


class OutputProcessor:
    def __init__(self, tokenizer: Any, context_limit: int) -> None:
        self.tokenizer = tokenizer
        self.context_limit = context_limit
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(x for x in {eos} if x is not None)
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def init_request(self, req: Req) -> None:
        p = req.params
        req.detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output, prompt_ids=req.prompt_ids)

    def append_tokens(self, reqs: list[Req], sample: Any, step: int) -> None:
        now = time.perf_counter()
        for i, req in enumerate(reqs):
            req.output_ids.append(sample.next_token_ids[i])
            req.output_logprobs.append(sample.logprobs[i])
            req.output_ranks.append(sample.ranks[i])
            req.output_top_logprobs.append(sample.top_logprobs[i][: req.params.top_logprobs])
            if req.first_token_time is None:
                req.first_token_time = now
            req.token_times.append(now)

    def detokenize(self, req: Req, new_ids: list[int]) -> DetokUpdate:
        return req.detok.push(new_ids)

    def decide_finish(self, req: Req, detok: DetokUpdate) -> FinishResult:
        p = req.params
        result = decide_finish(FinishInputs(
            aborted=req.abort_reason, num_output_tokens=len(req.output_ids), max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens, seq_len=req.seq_len, context_limit=self.context_limit,
            last_token_id=req.output_ids[-1] if req.output_ids else None, eos_token_ids=self.eos_token_ids,
            ignore_eos=p.ignore_eos, stop_token_ids=tuple(p.stop_token_ids),
            stop_string_matched=detok.stop_matched, has_complete_tool_call=False))
        if result.finish_reason == "stop" and detok.stop_matched is not None:
            del req.output_ids[detok.stop_token_index:]
        return result

    def make_output(self, req: Req) -> tuple[RequestOutput, str]:
        """The final output, and the text the detokenizer still held back (the stream's last delta)."""
        tail = req.detok.flush()
        n = len(req.output_ids)
        logprobs = None
        if req.params.logprobs or req.params.top_logprobs:
            logprobs = [
                TokenLogprob(t, self.token_text(t), lp, rk, [(i, self.token_text(i), v) for i, v in top])
                for t, lp, rk, top in zip(req.output_ids, req.output_logprobs[:n], req.output_ranks[:n],
                                          req.output_top_logprobs[:n], strict=True)
            ]
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        times = req.token_times[:n]
        return RequestOutput(
            req_id=req.req_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids, text=req.detok.text,
            token_ids=list(req.output_ids), finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            evidence=req.evidence, logprobs=logprobs, usage={
                "prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                "cached_prompt_tokens": req.cached_prompt_tokens},
            timings={"ttft": ttft, "itl": [b - a for a, b in zip(times, times[1:])],
                     "e2e": time.perf_counter() - req.arrival_time, "preemptions": req.num_preemptions},
            error=req.error), tail
