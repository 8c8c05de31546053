"""What to capture inside the forward pass: the `CaptureSpec` record and its validation.

Owns: the setting a caller passes as `Engine(capture=...)` (for every request, or the ids in
`requests`) or as `add_request(..., capture=...)` (for that request): which output positions
(all, the first N, those whose top-2 probability margin is under a threshold) and what (the
residual stream after each layer, its norms, the logit lens, the attention weights), with the
sizes of what is kept. `CaptureSpec.parse` turns what callers write (True, a dict, a spec) into a
validated spec, raising ValueError that names the parameter and the allowed range. Does not own:
capturing (capture.py) or storing (tracing.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

WHAT = ("hidden", "norms", "lens", "attention")
MAX_LENS_TOPK = 100
MAX_ATTENTION_TOPK = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureSpec:
    """Which requests and output positions to look inside, and what to keep of each.

    `positions`: "all" or N (the first N output positions). `margin`: when set, only positions whose
    top-2 probability margin (p1 - p2 of the logits the sampler saw) is under it. `what`: any of
    hidden (residual after each layer, `[layers + 1, hidden]`, entry 0 the embeddings), norms (their
    L2 norms), lens (each entry through the final norm and lm_head: top `lens_topk` with logprobs and
    the rank of the token finally chosen), attention (per layer and head over the request's
    positions: top `attention_topk` positions and the entropy, or every weight with
    `attention_whole`). `requests` (engine-wide spec only): "all" or the request ids to capture."""

    requests: str | tuple[str, ...] = "all"
    positions: str | int = "all"
    margin: float | None = None
    what: tuple[str, ...] = WHAT
    lens_topk: int = 10
    attention_topk: int = 10
    attention_whole: bool = False

    @classmethod
    def parse(cls, value: Any, name: str = "capture") -> CaptureSpec | None:
        """None/False -> None; True -> the default spec; a dict or a spec -> validated spec."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"{name}: unknown keys {sorted(unknown)}; allowed are "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            value = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be True, a dict or a CaptureSpec, got {type(value).__name__}")
        value.validate(name)
        return value

    def validate(self, name: str = "capture") -> None:
        if not (self.requests == "all" or (isinstance(self.requests, tuple)
                                           and all(isinstance(r, str) for r in self.requests))):
            raise ValueError(f"{name}.requests must be 'all' or a list of request ids, got {self.requests!r}")
        if self.positions != "all" and (not _is_int(self.positions) or self.positions < 1):
            raise ValueError(f"{name}.positions must be 'all' or an int >= 1 (the first N output positions), "
                             f"got {self.positions!r}")
        if self.margin is not None and (isinstance(self.margin, bool) or not isinstance(self.margin, (int, float))
                                        or not 0.0 < self.margin <= 1.0):
            raise ValueError(f"{name}.margin must be None or a top-2 probability margin in (0, 1], "
                             f"got {self.margin!r}")
        if not isinstance(self.what, tuple) or not self.what or any(w not in WHAT for w in self.what):
            raise ValueError(f"{name}.what must be a non-empty list of {list(WHAT)}, got {self.what!r}")
        if not _is_int(self.lens_topk) or not 1 <= self.lens_topk <= MAX_LENS_TOPK:
            raise ValueError(f"{name}.lens_topk must be an int in [1, {MAX_LENS_TOPK}], got {self.lens_topk!r}")
        if not _is_int(self.attention_topk) or not 1 <= self.attention_topk <= MAX_ATTENTION_TOPK:
            raise ValueError(f"{name}.attention_topk must be an int in [1, {MAX_ATTENTION_TOPK}], "
                             f"got {self.attention_topk!r}")
        if not isinstance(self.attention_whole, bool):
            raise ValueError(f"{name}.attention_whole must be a bool, got {self.attention_whole!r}")

    def wants(self, position: int) -> bool:
        """Whether output `position` is in range (the margin test needs the step's logits: capture.py)."""
        return self.positions == "all" or position < self.positions

    def covers(self, req_id: str) -> bool:
        return self.requests == "all" or req_id in self.requests

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["what"] = list(self.what)
        if isinstance(self.requests, tuple):
            out["requests"] = list(self.requests)
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
