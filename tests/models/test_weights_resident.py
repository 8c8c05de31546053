"""A loaded CPU model's weights are resident from load on: safetensors maps the file, and without
`loader.page_in` the embedding table's pages were faulted in one by one as new tokens first came
up, mid-request (a server's memory crept up by 2.2 MB in its first 5,000-prompt burst)."""

from __future__ import annotations

from pathlib import Path

from workbench.models import load_model


def _mapping_rss_kb(address: int) -> tuple[str, int, int]:
    """(file, size in KB, resident KB) of this process's mapping holding `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split(maxsplit=5)
        if "-" not in head[0] or len(head) < 5 or ":" not in head[3]:
            continue
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        if lo <= address < hi:
            rss = next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
            return (head[5] if len(head) > 5 else ""), (hi - lo) // 1024, rss
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_embedding_table_is_resident_before_any_token_is_read():
    lm = load_model("tiny-random", device="cpu")
    table = lm.model.get_input_embeddings().weight
    name, size_kb, rss_kb = _mapping_rss_kb(table.data_ptr())
    assert name.endswith(".safetensors"), f"the table is not read from the mapped file ({name!r})"
    # every tensor of the file is a parameter: all of the mapping but its header page is resident
    assert rss_kb >= size_kb - 8, f"{rss_kb} of {size_kb} KB of {name} resident after load"


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
