"""Checked replacements: every kernel or shortcut the engine runs in place of what the model asks
for, each checked against what it replaces before its result is used (docs/kernels.md).

One mechanism for all of them: a `Replacement` declared in `registry.REGISTRY` (what it replaces,
how it is checked, what its verdict depends on), one `Verdict` type (verdict.py), one process book
that decides and keeps verdicts (`book.BOOK`), one store on disk under the cache root (store.py),
one environment switch (switch.py, `WORKBENCH_REPLACEMENTS`) and one section of the engine report
(`Book.report()`, `ModelRunner.kernel_report()["checks"]`).

The replacements that live here, each beside its check: the GEMM routes (gemm.py), the paged
decode-attention kernel (decode_attention.py), the sampler's draw and rank count (sampling.py),
with the C sources in c/ and their build in native.py. Two live with the code they stand in for,
in engine/run/: the direct forward (exact_forward.py) and the attention-variant probe
(variants.py). This package imports neither run/ nor sample/: they import it.
"""

from workbench.engine.kernels.book import BOOK, Book
from workbench.engine.kernels.registry import REGISTRY
from workbench.engine.kernels.store import Store
from workbench.engine.kernels.verdict import CHECKED_NOW, Replacement, Verdict, cached_from

__all__ = ["BOOK", "CHECKED_NOW", "REGISTRY", "Book", "Replacement", "Store", "Verdict", "cached_from"]
