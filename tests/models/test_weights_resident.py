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
