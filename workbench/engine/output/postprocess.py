"""Output processing: appending sampled tokens, detokenizing, deciding finish, building outputs.

Owns: the per-request glue of the pipeline's tail — `append_tokens` (ids, logprobs, timings),
`process_token` (the request's IncrementalDetokenizer and finish.py's ordered checks with this
request's inputs), `finish_index` (where a multi-token speculative run must stop, by the same
rules) and `make_output` (`Finished`). Does not own: the rules themselves (detokenizer.py,
finish.py, tool_parser.py), the step's order (stage.py) or tracing (tracing.py).
"""

from __future__ import annotations

import time
from typing import Any

from workbench.engine.output.detokenizer import DetokUpdate, IncrementalDetokenizer
from workbench.engine.output.finish import FinishInputs, FinishResult, decide_finish, stops_by_token
from workbench.engine.output.output import Finished, RequestOutput, TokenLogprob
from workbench.engine.output.tool_parser import StreamingToolParser
from workbench.engine.sample.grammar import accept_tokens
from workbench.engine.sched.request import Req


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

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """`token_text` of each id: looked up in one C call where the table has them all."""
        try:
            return list(map(self._token_text.__getitem__, token_ids))
        except KeyError:
            return [self.token_text(t) for t in token_ids]

    def step_logprobs(self, req: Req, ids: list[int]) -> list[TokenLogprob] | None:
        """Logprobs of the tokens `ids` this step appended to `req` (None when it asked for none).

        The per-token lists are read from their ends: a stop-string cut shortens `output_ids`, not them.
        """
        params, n = req.params, len(ids)
        if not (params.logprobs or params.top_logprobs) or n == 0 or len(req.output_logprobs) < n:
            return None
        lps, ranks, tops = req.output_logprobs[-n:], req.output_ranks[-n:], req.output_top_logprobs[-n:]
        text = self.token_text
        return [TokenLogprob(t, text(t), lp, rk, [(i, text(i), v) for i, v in top[: params.top_logprobs]])
                for t, lp, rk, top in zip(ids, lps, ranks, tops)]

    def fill_token_text(self) -> int:
        """Decode every token of the vocabulary into the token-text table now; returns how many.

        Filled lazily, the table grows during each burst of traffic by the tokens that burst saw
        first, and each of those small strings is allocated among the burst's short-lived objects:
        it keeps their memory pages from going back once they are freed (a server's idle memory crept
        up round after round, issue 19). Filled at once at start, it is one block that stays.
        About 0.3 s for SmolLM2's 49,152 tokens."""
        n = len(self.tokenizer)
        for token_id in range(n):
            self.token_text(token_id)
        return n

    def init_request(self, req: Req) -> None:
        p = req.params
        req.detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output, prompt_ids=req.prompt_ids,
            min_new_tokens=p.min_new_tokens)
        req.tool_parser = StreamingToolParser() if p.parse_tool_calls else None

    def append_tokens(self, reqs: list[Req], sample: Any, step: int) -> None:
        now = time.perf_counter()
        for i, req in enumerate(reqs):
            req.output_ids.append(sample.next_token_ids[i])
            req.output_logprobs.append(sample.logprobs[i])
            req.output_ranks.append(sample.ranks[i])
            req.output_top_logprobs.append(sample.top_logprobs[i][: req.params.top_logprobs])
            if req.params.token_ids_logprob:
                req.output_token_ids_logprobs.append(sample.token_ids_logprobs[i])
            accept_tokens(req.grammar, [sample.next_token_ids[i]])
            if req.first_token_time is None:
                req.first_token_time = now
            req.token_times.append(now)

    def _inputs(self, req: Req, n: int, stop_string: str | None = None) -> FinishInputs:
        """Finish inputs as of output token `n` (1-based) of `req`."""
        p = req.params
        return FinishInputs(
            aborted=req.abort_reason, num_output_tokens=n, max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens, seq_len=len(req.prompt_ids) + n, context_limit=self.context_limit,
            last_token_id=req.output_ids[n - 1], eos_token_ids=self.eos_token_ids, ignore_eos=p.ignore_eos,
            stop_token_ids=tuple(p.stop_token_ids) + self._grammar_stop(req), stop_string_matched=stop_string,
            has_complete_tool_call=req.tool_parser is not None and req.tool_parser.has_complete_call)

    def process_token(self, req: Req, n: int) -> tuple[DetokUpdate, FinishResult]:
        """Output token `n` (1-based) of `req` through detokenizer, tool parser and finish checks.

        Order (vLLM semantics): a token that stops the request by id is not shown as text unless
        `include_stop_str_in_output`; a completed stop string cuts the ids after it.
        """
        token = req.output_ids[n - 1]
        if not req.params.include_stop_str_in_output and stops_by_token(self._inputs(req, n)):
            upd = req.detok.push([])
        else:
            upd = req.detok.push([token])
        if req.tool_parser is not None and upd.delta:
            req.tool_parser.feed(upd.delta)
        result = decide_finish(self._inputs(req, n, upd.stop_matched))
        return upd, result

    def finish_index(self, req: Req, tokens: list[int]) -> int:
        """How many of `tokens` (proposed for `req`, not yet appended) may be appended: through the
        first one that ends the request by finish.py's rules. Stop strings are left to the
        detokenizer when the tokens are processed; a grammar's stop tokens count as stop tokens."""
        p = req.params
        stop_ids = tuple(p.stop_token_ids) + (tuple(req.grammar.stop_token_ids) if req.grammar is not None else ())
        done = len(req.output_ids)
        for j, tok in enumerate(tokens):
            n = done + j + 1
            inputs = FinishInputs(  # no abort: aborts end requests between steps
                num_output_tokens=n, max_new_tokens=p.max_new_tokens,
                min_new_tokens=p.min_new_tokens, seq_len=len(req.prompt_ids) + n, context_limit=self.context_limit,
                last_token_id=tok, eos_token_ids=self.eos_token_ids, ignore_eos=p.ignore_eos, stop_token_ids=stop_ids)
            if decide_finish(inputs).finished:
                return j + 1
        return len(tokens)

    def truncate(self, req: Req, n: int) -> None:
        """Drop output tokens after the `n`-th (a finish inside a multi-token step, e.g. speculation)."""
        for seq in (req.output_ids, req.output_logprobs, req.output_ranks, req.output_top_logprobs,
                    req.output_token_ids_logprobs, req.token_times):
            del seq[n:]

    @staticmethod
    def _tool_calls(req: Req, tail: str) -> list[dict[str, Any]] | None:
        parser = req.tool_parser
        if parser is None:
            return None
        if tail:
            parser.feed(tail)
        parser.finish()
        return [c.to_openai() for c in parser.tool_calls] or None

    @staticmethod
    def _grammar_stop(req: Req) -> tuple[int, ...]:
        """A completed grammar ends the request at its stop token even with ignore_eos."""
        return (req.output_ids[-1],) if req.grammar is not None and req.grammar.terminated else ()

    def prompt_logprobs(self, req: Req) -> list[dict[str, Any] | None] | None:
        """Per prompt token: None for the first, then its logprob, rank and top alternatives."""
        if not req.params.prompt_logprobs:
            return None
        out: list[dict[str, Any] | None] = [None]
        for t, lp, rk, top in zip(req.prompt_ids[1:], req.prompt_logprobs[1:], req.prompt_ranks[1:],
                                  req.prompt_top_logprobs[1:]):
            out.append({"token_id": t, "token": self.token_text(t), "logprob": lp, "rank": rk,
                        "top_logprobs": [(i, self.token_text(i), v) for i, v in top]})
        return out

    def make_output(self, req: Req) -> Finished:
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
        times = req.token_times[:n]
        out = RequestOutput(
            req_id=req.req_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids, text=req.detok.text,
            token_ids=list(req.output_ids), finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            evidence=req.evidence, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs(req), usage={
                "prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                "cached_prompt_tokens": req.cached_prompt_tokens},
            timings={**req.timing.summary(times, time.perf_counter()), "preemptions": req.num_preemptions},
            spec=req.spec_stats.to_dict() if req.spec_stats is not None else None,
            tool_calls=self._tool_calls(req, tail), error=req.error,
            token_ids_logprobs=list(req.output_token_ids_logprobs[:n]) if req.params.token_ids_logprob else None)
        return Finished(out, tail)
