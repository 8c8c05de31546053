"""What a server's engine keeps once a burst is over (issue 19; tiny-random, a real engine thread).

The RSS test (test_server_memory.py) shows the sum; these pin its parts, each of which kept memory
from a burst alive while the server sat idle: the loop's handle table sized for the burst, the last
step's outputs and requests referenced from the engine thread's frame, the last forward batch kept
on the engine's step record, and token texts decoded lazily during the burst.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

from workbench.engine.engine import Engine
from workbench.engine.output.output import StepOutput
from workbench.engine.run.forward_batch import ForwardBatch
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.request import Req
from workbench.server.engine_loop import EngineLoop
from workbench.server.heap import IDLE_RELEASE_AFTER

PROMPTS, N = 300, 2


async def _burst(engine: Engine) -> EngineLoop:
    loop = EngineLoop(engine)
    loop.start()
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True, n=N)
    handle = await loop.submit([f"story number {i}" for i in range(PROMPTS)], params, "burst")
    done = 0
    while done < PROMPTS * N:
        item = await asyncio.wait_for(handle.queue.get(), 120)
        assert item.error is None, item.error
        done += item.finished
    del handle, item
    deadline = time.monotonic() + 30
    while engine.has_work() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(IDLE_RELEASE_AFTER[-1] + 0.5)  # idle long enough for every hand-back
    return loop


def test_an_idle_engine_keeps_nothing_of_the_burst_it_served(tiny):
    engine = Engine(tiny)

    def alive() -> list[str]:  # this burst's requests and outputs, and any engine's forward batches
        gc.collect()
        return [type(o).__name__ for o in gc.get_objects()
                if type(o) is ForwardBatch or (type(o) in (StepOutput, Req) and o.req_id.startswith("burst"))]

    async def run() -> None:
        before = alive()  # other tests' objects, if any are still held, are not this burst's
        loop = await _burst(engine)
        try:
            left = alive()
            assert left == before, f"objects of the last steps still alive: {sorted(set(left) - set(before))}"
            assert engine.step_no > 0 and engine.clock.start > 0  # the step's record stays, its batch does not
            # 600 ids went through the handle table: emptied, it must not keep a table sized for them
            assert sys.getsizeof(loop._handles) == sys.getsizeof({})
        finally:
            await loop.stop()

    try:
        asyncio.run(run())
    finally:
        engine.close()


def test_the_token_text_table_filled_at_once_spells_every_token_as_decode_does(tiny):
    engine = Engine(tiny)
    try:
        tok = tiny.tokenizer
        assert engine.fill_token_text() == len(tok)
        for token_id in (0, 1, 2, 17375, 216, len(tok) - 1):  # specials, word pieces, the last id
            assert engine.token_text(token_id) == tok.decode([token_id], skip_special_tokens=False)
    finally:
        engine.close()
