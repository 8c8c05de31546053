"""Shared fixtures: loaded models (once per session) and transformers references.

Models load from the workbench cache (~/.cache/workbench), so only the first run on a machine pays
for dequantizing the GGUF file.
"""

from __future__ import annotations

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
