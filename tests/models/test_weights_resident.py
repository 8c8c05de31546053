"""A loaded CPU model's weights are resident from load on: safetensors maps the file, and without
`loader.page_in` the embedding table's pages were faulted in one by one as new tokens first came
up, mid-request (a server's memory crept up by 2.2 MB in its first 5,000-prompt burst)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.models import load_model
from workbench.models.loader import huge_pages_available


def _mapping(address: int) -> tuple[str, int, dict[str, int]]:
    """(file, size in KB, its smaps fields in KB) of this process's mapping holding `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split(maxsplit=5)
        if "-" not in head[0] or len(head) < 5 or ":" not in head[3]:
            continue
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        if lo <= address < hi:
            fields = {}
            for x in lines[i + 1:]:
                parts = x.split()
                if not parts[0].endswith(":") or "-" in parts[0]:
                    break
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0][:-1]] = int(parts[1])
            return (head[5] if len(head) > 5 else ""), (hi - lo) // 1024, fields
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_embedding_table_is_resident_before_any_token_is_read():
    lm = load_model("tiny-random", device="cpu")
    table = lm.model.get_input_embeddings().weight
    name, size_kb, fields = _mapping(table.data_ptr())
    assert name.endswith(".safetensors"), f"the table is not read from the mapped file ({name!r})"
    # every tensor of the file is a parameter: all of the mapping but its header page is resident
    assert fields["Rss"] >= size_kb - 8, f"{fields['Rss']} of {size_kb} KB of {name} resident after load"


@pytest.mark.skipif(not huge_pages_available(), reason="this system offers no transparent huge pages")
def test_workbench_serves_smollm2_from_huge_pages_with_the_same_values():
    # a batch-1 step streams every weight once: in 2 MB pages instead of 4 KB ones it took 4-6% less
    # time (benchmarks/weights_pages.py), which a server wins back; the values, and tied weights'
    # sharing, must not change
    import argparse

    from workbench.server.cli_args import add_serve_args, build_server

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine, _ = build_server(parser.parse_args(["--model", "smollm2", "--device", "cpu", "--trace-level", "off"]))
    engine.close()
    lm = engine.loaded
    plain = load_model("smollm2", device="cpu")
    params = dict(lm.model.named_parameters(remove_duplicate=False))
    for key, value in plain.model.named_parameters(remove_duplicate=False):
        assert torch.equal(params[key], value), key
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    name, size_kb, fields = _mapping(lm.model.model.layers[3].mlp.up_proj.weight.data_ptr())
    assert name == "", f"the weights are still in a file's mapping ({name!r})"
    weights_kb = sum(p.numel() * 4 for p in lm.model.parameters()) // 1024
    assert fields["Rss"] >= weights_kb, f"{fields['Rss']} KB resident of {weights_kb} KB of weights"
    # the kernel may fall back to 4 KB pages where it finds no free 2 MB block: most must be huge
    assert fields["AnonHugePages"] >= 0.9 * weights_kb, f"{fields['AnonHugePages']} KB of {weights_kb} in huge pages"


@pytest.mark.skipif(not huge_pages_available(), reason="this system offers no transparent huge pages")
def test_the_python_api_and_a_one_shot_workbench_generate_leave_the_weights_in_their_file_mapping():
    # the copy into huge pages cost 1-9 s in a fresh process on these VMs (the first touch of free
    # 2 MB blocks waits on the host), more than a notebook's or a one-shot run's tokens win back
    import argparse

    from workbench.engine.engine import Engine

    with Engine("smollm2", trace_level="off") as engine:
        name, _, _ = _mapping(engine.loaded.model.model.layers[3].mlp.up_proj.weight.data_ptr())
        assert name.endswith(".safetensors"), f"Engine('smollm2') copied the weights out of the file ({name!r})"

    from workbench.cli.generate import _make_engine, add_generate_args

    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    engine = _make_engine(parser.parse_args(["hello", "--model", "smollm2", "--device", "cpu"]))
    try:
        name, _, _ = _mapping(engine.loaded.model.model.layers[3].mlp.up_proj.weight.data_ptr())
        assert name.endswith(".safetensors"), f"the weights were copied out of the file ({name!r})"
    finally:
        engine.close()


def test_tensors_without_a_plain_byte_view_are_left_to_their_first_read():
    # A quantized buffer's byte view crashed the process when summed (torch 2.13), so a model holding
    # one failed to load; a sparse one has no data pointer of its own. Run in a child: a crash is a failure.
    import subprocess
    import sys

    code = """
import torch
from workbench.models.loader import page_in
m = torch.nn.Module()
m.register_buffer("q", torch.quantize_per_tensor(torch.randn(4096), 0.1, 0, torch.qint8))
m.register_buffer("s", torch.eye(3).to_sparse())
m.register_buffer("b", torch.ones(5000, dtype=torch.bool))
m.lin = torch.nn.Linear(64, 64)
page_in(m)
print("loaded")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "loaded", run.stderr[-2000:]


def test_a_model_larger_than_half_the_available_memory_stays_in_its_file_mapping(monkeypatch):
    # a private copy of a model the kernel can only page from its file would run the machine out of
    # memory: such a model keeps the mapping (read once at load), as every model did before huge pages
    from workbench.models import loader

    monkeypatch.setattr(loader, "available_bytes", lambda: 800 << 20)  # SmolLM2's 538 MB > 400 MB
    lm = load_model("smollm2", device="cpu", huge_pages=True)
    name, size_kb, fields = _mapping(lm.model.model.layers[3].mlp.up_proj.weight.data_ptr())
    assert name.endswith(".safetensors"), f"the weights left the file mapping ({name!r})"
    assert fields["Rss"] >= size_kb - 8
