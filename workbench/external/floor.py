"""The noise floor: how much an engine disagrees with itself, measured, saved, and used to classify.

Owns: `Floor` (the measurement: per-band figures of |Δlogprob| between two runs of the same
requests, and the argmax flips with their margins), comparing two traces of the same requests into
one (`floor_from_traces`), running the two probes that produce them (`measure_floor`: the same
requests twice to one server, or once to each of two replicas), the JSON file (`save` / `load_floor`,
`floor_from_json`; untrusted on load) and the bound a check uses at one position (`bound`, `flip_bound`).

What is compared: each request's output positions in order while both runs chose the same token
(after a different token the two runs condition on different text). At every such position the
chosen token's |Δlogprob| and, for each token in both runs' top-k, its |Δlogprob|, each put in the
band of its own |logprob| (run A's): a token at logprob −0.001 and one at −7 move by different
amounts under the same rounding. A position where the runs chose different tokens is a flip; its
margin is how much run A preferred its own token (from A's top-k; greedy requests only: a seeded
draw that differs counts as a flip, but its margin says nothing about near ties). The bound of a band is the
largest |Δ| seen there; a band with fewer than `MIN_SAMPLES` figures takes the largest of all.

Does not own: probing (probe.py), the check's verdicts (check.py applies `bound` and `flip_bound`),
the trace diff (trace/diff.py, whose position alignment this reuses).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# |logprob| band edges: near-certain, likely, plausible, unlikely, tail, far tail
EDGES = (0.0, 0.01, 0.1, 1.0, 3.0, 10.0, math.inf)
MIN_SAMPLES = 20  # fewer figures than this in a band: its bound is the largest of all bands
FORMAT = "workbench.floor"
VERSION = 1
MAX_FILE_BYTES = 1 << 20  # a floor file is a few KB; anything bigger is not one


@dataclass(slots=True)
class FloorBand:
    """One |logprob| band: how far the same token's logprob moved between the two runs."""

    lo: float
    hi: float
    chosen: int = 0  # chosen-token positions compared in this band
    samples: int = 0  # figures in all (chosen and top-k tokens)
    max_abs: float = 0.0
    p50: float = 0.0
    p99: float = 0.0
    chosen_max: float = 0.0

    def label(self) -> str:
        return f"[{self.lo:g}, {self.hi:g})" if math.isfinite(self.hi) else f"≥{self.lo:g}"


@dataclass(slots=True)
class Floor:
    """An engine's run-to-run disagreement with itself, by |logprob| band, and its argmax flips."""

    bands: list[FloorBand]
    requests: int
    positions: int  # chosen-token positions compared (both runs chose the same token up to there)
    flips: int  # requests whose runs chose a different token somewhere
    flip_margins: list[float]  # run A's preference for its own token at each flip (when A's top-k has B's)
    identical_positions: int  # positions whose chosen logprob was bit-identical
    source: dict[str, Any] = field(default_factory=dict)  # urls, model, traces, created

    @property
    def max_abs(self) -> float:
        return max((b.max_abs for b in self.bands), default=0.0)

    @property
    def max_flip_margin(self) -> float:
        return max(self.flip_margins, default=0.0)

    def bound(self, logprob: float | None) -> float:
        """The largest |Δlogprob| the engine showed against itself for tokens near `logprob`."""
        if logprob is None or not math.isfinite(logprob):
            return self.max_abs
        a = abs(logprob)
        for band in self.bands:
            if band.lo <= a < band.hi:
                return band.max_abs if band.samples >= MIN_SAMPLES else self.max_abs
        return self.max_abs

    def flip_bound(self, logprob: float | None) -> float:
        """A reference preference this small can flip the engine's own choice: twice the band's
        bound (both tokens' logprobs move) or the largest margin at which the engine flipped."""
        return max(2 * self.bound(logprob), self.max_flip_margin)

    def summary(self) -> dict[str, Any]:
        """What a check stores and shows beside its figures."""
        return {"source": self.source, "positions": self.positions, "requests": self.requests, "flips": self.flips,
                "max_abs": self.max_abs, "max_flip_margin": self.max_flip_margin,
                "bands": [{"band": b.label(), "samples": b.samples, "bound": b.max_abs} for b in self.bands if b.samples]}

    def describe(self) -> str:
        src = self.source
        where = src.get("url", "?") + (f" and {src['url2']}" if src.get("url2") else " (twice)")
        lines = [f"floor of {src.get('model') or 'the engine'} at {where}: {self.requests} requests, "
                 f"{self.positions} positions compared",
                 f"  identical logprobs  {self.identical_positions}/{self.positions} positions",
                 f"  max |Δlogprob|      {self.max_abs:.4g} nats",
                 f"  argmax flips        {self.flips} request(s)"
                 + (f", largest margin {self.max_flip_margin:.4g} nats" if self.flip_margins else ""),
                 "",
                 f"  {'|logprob| band':<14} {'chosen':>7} {'figures':>8} {'max|Δ|':>10} {'p50':>10} {'p99':>10}"]
        for b in self.bands:
            lines.append(f"  {b.label():<14} {b.chosen:>7} {b.samples:>8} {b.max_abs:>10.3g} {b.p50:>10.3g} "
                         f"{b.p99:>10.3g}" + ("" if b.samples >= MIN_SAMPLES or not b.samples else "  (few: the overall max is used)"))
        return "\n".join(lines)

    # --- the file --------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **{k: v for k, v in asdict(self).items()},
                "bands": [{**asdict(b), "hi": None if not math.isfinite(b.hi) else b.hi} for b in self.bands]}

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path


def load_floor(path: str | os.PathLike[str]) -> Floor:
    """Read a floor file written by `Floor.save` (untrusted: size, types and ranges are checked)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"floor: no such file: {os.fspath(path)!r}")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"floor: {path.name} is over {MAX_FILE_BYTES} bytes; not a floor file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"floor: {path.name} is not JSON ({exc})") from None
    return floor_from_json(obj, path.name)


def floor_from_json(obj: Any, name: str = "floor") -> Floor:
    """A `Floor` from what `Floor.to_json` wrote (untrusted: types and ranges are checked); `name` says
    where it came from in the error."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"floor: {name} is not a floor file (format must be {FORMAT!r}; "
                         "write one with `workbench floor`)")
    if obj.get("version") != VERSION:
        raise ValueError(f"floor: {name} has version {obj.get('version')!r}; this workbench reads {VERSION}")
    try:
        bands = [FloorBand(lo=_num(b["lo"]), hi=math.inf if b["hi"] is None else _num(b["hi"]),
                           chosen=_count(b["chosen"]), samples=_count(b["samples"]), max_abs=_num(b["max_abs"]),
                           p50=_num(b["p50"]), p99=_num(b["p99"]), chosen_max=_num(b["chosen_max"]))
                 for b in obj["bands"]]
        margins = [_num(m) for m in obj["flip_margins"]]
        source = obj.get("source") if isinstance(obj.get("source"), dict) else {}
        return Floor(bands, _count(obj["requests"]), _count(obj["positions"]), _count(obj["flips"]), margins,
                     _count(obj["identical_positions"]), source)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"floor: {name} is missing or mistypes a field ({exc})") from None


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"floor: expected a finite number >= 0, got {v!r}")
    return float(v)


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"floor: expected a count >= 0, got {v!r}")
    return v


# --- measuring ------------------------------------------------------------------------------------


def floor_from_traces(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str],
                      source: dict[str, Any] | None = None) -> Floor:
    """Compare two traces of the same requests (paired by id, else by order) into a `Floor`."""
    from workbench.trace.diff import diff_traces
    from workbench.trace.reader import open_trace

    with open_trace(path_a) as a, open_trace(path_b) as b:
        report = diff_traces(a, b)
    figures: list[list[float]] = [[] for _ in range(len(EDGES) - 1)]
    chosen: list[list[float]] = [[] for _ in range(len(EDGES) - 1)]
    positions = identical = flips = 0
    margins: list[float] = []
    for r in report.requests:
        for p in r.positions:
            if p.token_a != p.token_b:
                flips += 1
                v = p.verdict  # a greedy flip's margin: how close a call the engine's noise turned
                if (v is not None and not v.sampled and v.margin is not None and v.margin >= 0
                        and p.token_b in {int(t[0]) for t in p.top_a}):
                    margins.append(v.margin)
                break
            lp_a = p.logprob_a if p.logprob_a is not None else _chosen_logprob(p.top_a, p.token_a)
            if p.logprob_delta is not None and lp_a is not None:
                positions += 1
                identical += p.logprob_delta == 0.0
                chosen[_band(lp_a)].append(p.logprob_delta)
                figures[_band(lp_a)].append(p.logprob_delta)
            top_b = {int(t[0]): t[1] for t in p.top_b if t[1] is not None}
            for t in p.top_a:
                tid, lp = int(t[0]), t[1]
                if lp is None or tid == p.token_a or tid not in top_b:
                    continue
                figures[_band(lp)].append(abs(lp - top_b[tid]))
    if positions == 0:
        raise ValueError("floor: the two runs share no position with a logprob to compare "
                         "(did both runs record logprobs, and of the same requests?)")
    bands = []
    for i, (lo, hi) in enumerate(zip(EDGES, EDGES[1:])):
        values = sorted(figures[i])
        bands.append(FloorBand(lo, hi, len(chosen[i]), len(values), values[-1] if values else 0.0,
                               _quantile(values, 0.5), _quantile(values, 0.99), max(chosen[i], default=0.0)))
    src = {"traces": [os.fspath(path_a), os.fspath(path_b)], "created": time.time(), **(source or {})}
    return Floor(bands, len(report.requests), positions, flips, margins, identical, src)


def _chosen_logprob(top: list[Any], token: int) -> float | None:
    for t in top:
        if int(t[0]) == token and t[1] is not None:
            return float(t[1])
    return None


def _band(logprob: float) -> int:
    a = abs(logprob)
    for i, hi in enumerate(EDGES[1:]):
        if a < hi:
            return i
    return len(EDGES) - 2


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def measure_floor(url: str, requests: list[Any], out: str | os.PathLike[str] | None = None, *,
                  url2: str | None = None, traces: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
                  **probe_args: Any) -> Floor:
    """Send `requests` (ProbeRequests) to `url` twice, or once to `url` and once to `url2`, and measure
    the floor between the two runs. `traces`: where to keep the two probe traces (default: a
    temporary folder, removed). `out`: save the floor there. `probe_args` go to `probe` (model,
    concurrency, top_logprobs, max_tokens, api_key, tokenizer, defaults, timeout, progress)."""
    import tempfile

    from workbench.external.probe import base_url, probe

    with tempfile.TemporaryDirectory(prefix="workbench-floor-") as tmp:
        pa, pb = traces or (Path(tmp) / "a.wbtrace", Path(tmp) / "b.wbtrace")
        results = [probe(u, requests, p, **probe_args) for u, p in ((url, pa), (url2 or url, pb))]
        failed = [e for r in results for e in r.errors]
        if failed:
            raise ValueError(f"floor: {len(failed)} request(s) failed, the runs cannot be compared: {failed[0]}")
        source = {"url": base_url(url), "url2": base_url(url2) if url2 else None, "model": results[0].model}
        floor = floor_from_traces(pa, pb, source)
        if traces is None:
            floor.source["traces"] = None  # they were temporary
    if out is not None:
        floor.save(out)
    return floor
