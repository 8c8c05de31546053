"""Pearson's chi-square tests for the sampling-distribution tests, without scipy.

transformers imports `scipy.optimize` whenever scipy is installed (about 0.6 s of every model load),
so the project's environment does not carry scipy for two tests: the p-values come from the
chi-square survival function, the regularized upper incomplete gamma `Q(dof / 2, stat / 2)`, which
torch has (`torch.special.gammaincc`). Same statistics and p-values as `scipy.stats.chisquare` and
`scipy.stats.chi2_contingency` (with its Yates correction for one degree of freedom).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chisquare_pvalue(observed: Sequence[float], expected: Sequence[float]) -> float:
    """Goodness of fit of `observed` counts to `expected` ones (same totals), `len - 1` degrees of freedom."""
    o, e = np.asarray(observed, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if o.shape != e.shape or o.ndim != 1 or len(o) < 2:
        raise ValueError(f"observed and expected: two 1-D arrays of the same length >= 2, got {o.shape}, {e.shape}")
    return _sf(float(((o - e) ** 2 / e).sum()), len(o) - 1)


def contingency_pvalue(table: np.ndarray) -> float:
    """Independence of the rows and columns of a table of counts."""
    t = np.asarray(table, dtype=np.float64)
    if t.ndim != 2 or min(t.shape) < 1:
        raise ValueError(f"table: a 2-D array of counts, got shape {t.shape}")
    dof = (t.shape[0] - 1) * (t.shape[1] - 1)
    if dof == 0:  # one row or one column: nothing to test, as scipy says (p = 1)
        return 1.0
    expected = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    diff = t - expected
    if dof == 1:  # Yates: move each count half a unit towards its expectation (never past it)
        diff = np.sign(diff) * np.maximum(np.abs(diff) - 0.5, 0.0)
    return _sf(float((diff ** 2 / expected).sum()), dof)
