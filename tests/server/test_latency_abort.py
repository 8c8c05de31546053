"""Disconnect, send timeout and shutdown arriving together abort a request exactly once (tiny-random model).

The three paths end in the same call: the stream generator's `finally` (disconnect) and the
socket writer (send timeout) call `EngineLoop.abort(handle, reason)`, and `EngineLoop.stop()`
(shutdown) aborts every open handle. Here they are released at the same instant from three threads
by a barrier, several times over, against a real engine thread.
"""

from __future__ import annotations

import asyncio
import threading

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.server.engine_loop import EngineLoop
from workbench.trace.recorder import MemorySink

REASONS = ("client disconnected", "send timeout")


async def _race(tiny, rid: str) -> tuple[Engine, MemorySink, EngineLoop, list[bool], object]:  # noqa: ANN001
    recorder = MemorySink()
    engine = Engine(tiny, trace_level="summary", trace_sinks=[recorder])
    loop = EngineLoop(engine)
    loop.start()
    params = SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True)
    handle = await loop.submit(["Tell me everything about lighthouses."], params, rid)
    for _ in range(3):  # the request is running: a few deltas arrived
        await handle.queue.get()
    ev_loop = asyncio.get_running_loop()
    barrier = threading.Barrier(3)
    results: list[bool] = []
    lock = threading.Lock()

    def abort_from_thread(reason: str) -> None:
        barrier.wait()
        ok = loop.abort(handle, reason)
        with lock:
            results.append(ok)

    stopping = []

    def shutdown_from_thread() -> None:
        barrier.wait()
        stopping.append(asyncio.run_coroutine_threadsafe(loop.stop(), ev_loop))

    threads = [threading.Thread(target=abort_from_thread, args=(r,)) for r in REASONS]
    threads.append(threading.Thread(target=shutdown_from_thread))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        await asyncio.sleep(0.01)
    await asyncio.wrap_future(stopping[0])
    return engine, recorder, loop, results, handle


def test_disconnect_timeout_and_shutdown_together_abort_once(tiny):
    for attempt in range(3):
        rid = f"race-{attempt}"
        engine, recorder, loop, results, handle = asyncio.run(_race(tiny, rid))
        stamps = [e for e in recorder.of_kind("stamp") if e.req_id == rid and e.stage == "aborted"]
        finished = [e for e in recorder.of_kind("request.finished") if e.req_id == rid]
        assert len(stamps) == 1, [s.detail for s in stamps]
        winner = stamps[0].detail["reason"]
        assert winner in (*REASONS, "server shutting down")
        assert handle.aborted == winner
        assert results.count(True) == (0 if winner == "server shutting down" else 1) and len(results) == 2
        assert [rid_ for rid_, _ in loop.recent_aborts] == [rid]  # the engine was asked once
        assert len(finished) == 1 and finished[0].finish_reason == "abort"
        assert finished[0].evidence["message"] == winner
        frees = [e for e in recorder.of_kind("kv") if e.req_id == rid and e.op == "free"]
        assert len(frees) == 1  # its KV slots were freed once
        alloc = engine.memory.allocator
        assert alloc.available_size() == alloc.size
        engine.close()


def test_abort_after_the_request_finished_does_nothing(tiny):
    async def run() -> tuple[bool, list]:
        recorder = MemorySink()
        engine = Engine(tiny, trace_level="summary", trace_sinks=[recorder])
        loop = EngineLoop(engine)
        loop.start()
        handle = await loop.submit(["Hi"], SamplingParams(temperature=0, max_new_tokens=3), "done-1")
        await handle.result()
        ok = loop.abort(handle, "client disconnected")
        await loop.stop()
        engine.close()
        return ok, [e for e in recorder.of_kind("stamp") if e.stage == "aborted"]

    ok, stamps = asyncio.run(run())
    assert ok is False and stamps == []
