"""Reading what capture kept inside the forward pass (issue 18), as numpy and pandas, without torch.

Owns: `InsideReader`, the methods `Trace` gets for `capture` events and their tensors:
`captures`, `hidden_states`, `residual_norms`, `logit_lens`, `lens_grid` (every captured position
of a request, for a heatmap) and `attention` (an `AttentionCapture`), plus `context_texts` (the
text each attended position points at). Residual entries are numbered by `layer`: -1 is the
embeddings, i the residual after decoder layer i; entry `layer` is row `layer + 1` of the arrays.
Does not own: capturing (workbench/engine/run/capture.py) or the file (reader.py, store.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workbench.trace.events import Captured, Event, RequestAdded, TokenChosen

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

LENS_COLUMNS = ["layer", "chosen_id", "chosen_text", "chosen_rank", "chosen_logprob", "chosen_prob",
                "top_ids", "top_texts", "top_logprobs"]


@dataclass(frozen=True, slots=True)
class AttentionCapture:
    """One position's attention: per layer and head, the most attended positions and their weights
    (`[layers, heads, k]`; with `whole`, every position `0..kv_len-1`) and the entropy `[layers, heads]`."""

    positions: np.ndarray
    weights: np.ndarray
    entropy: np.ndarray
    kv_len: int
    whole: bool

    @property
    def num_layers(self) -> int:
        return int(self.weights.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.weights.shape[1])

    def top(self, layer: int, head: int | None = None, k: int = 5) -> list[tuple[int, float]]:
        """The `k` most attended (position, weight) at `layer`: one head's, or the mean over heads."""
        import numpy as np

        if head is not None:
            pos, w = self.positions[layer, head], self.weights[layer, head]
        else:  # mean over heads of what each head kept (a position a head did not keep counts 0 there)
            total = np.zeros(self.kv_len)
            for h in range(self.num_heads):
                np.add.at(total, self.positions[layer, h], self.weights[layer, h])
            w = total / self.num_heads
            pos = np.arange(self.kv_len)
        order = np.argsort(-w, kind="stable")[:k]
        return [(int(pos[i]), float(w[i])) for i in order]

    def frame(self) -> pd.DataFrame:
        """One row per (layer, head, kept position): layer, head, position, weight."""
        import numpy as np
        import pandas as pd

        layers, heads, k = self.weights.shape
        lh = np.indices((layers, heads, k)).reshape(3, -1)
        return pd.DataFrame({"layer": lh[0], "head": lh[1], "position": self.positions.reshape(-1),
                             "weight": self.weights.reshape(-1)})


class InsideReader:
    """Mixed into `Trace`: reads `capture` events and their tensors (needs `events` and `tensor`)."""

    def events(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
               step_range: tuple[int, int] | None = None, limit: int | None = None) -> Iterator[Event]:
        raise NotImplementedError

    def tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def captures(self, req_id: str | None = None) -> list[Captured]:
        """Every capture event (of one request), in order; [] for a trace without capture."""
        return [e for e in self.events(kind="capture", req_id=req_id) if isinstance(e, Captured)]

    def capture(self, req_id: str, position: int) -> Captured:
        """The capture event of output `position` of `req_id`; KeyError saying what was captured."""
        caps = self.captures(req_id)
        for e in reversed(caps):  # a position recomputed after preemption: its latest capture
            if e.position == position:
                return e
        raise KeyError(f"{req_id!r} position {position} was not captured (captured positions: "
                       f"{[e.position for e in caps]})")

    def _quantity(self, req_id: str, position: int, quantity: str) -> np.ndarray:
        event = self.capture(req_id, position)
        name = event.tensors.get(quantity)
        if name is None:
            raise KeyError(f"{req_id!r} position {position}: {quantity!r} was not captured "
                           f"(captured: {event.what})")
        return self.tensor(name)

    def hidden_states(self, req_id: str, position: int) -> np.ndarray:
        """`[layers + 1, hidden]` float32: the embeddings, then the residual after each decoder layer
        (before the final norm), at the token whose logits chose output `position`."""
        return self._quantity(req_id, position, "hidden")

    def residual_norms(self, req_id: str, position: int) -> np.ndarray:
        """`[layers + 1]`: the L2 norm of each residual entry."""
        return self._quantity(req_id, position, "norms")

    def logit_lens(self, req_id: str, position: int) -> pd.DataFrame:
        """One row per residual entry (`layer` -1 = embeddings): the finally chosen token's rank,
        logprob and probability through that entry's lens, and the lens's top ids, texts, logprobs."""
        import numpy as np
        import pandas as pd

        event = self.capture(req_id, position)
        if "lens_ids" not in event.tensors:
            raise KeyError(f"{req_id!r} position {position}: the logit lens was not captured (captured: {event.what})")
        ids, logp, rank, picked = (self.tensor(event.tensors[q]) for q in
                                   ("lens_ids", "lens_logprobs", "lens_chosen_rank", "lens_chosen_logprob"))
        chosen_text = self._chosen_text(event)
        texts = event.lens_texts if len(event.lens_texts) == len(ids) else [[f"#{t}" for t in row] for row in ids]
        rows = [(i - 1, event.token_id, chosen_text, int(rank[i]), float(picked[i]), float(np.exp(picked[i])),
                 ids[i].tolist(), list(texts[i]), logp[i].tolist()) for i in range(len(ids))]
        return pd.DataFrame(rows, columns=LENS_COLUMNS)

    def lens_grid(self, req_id: str) -> pd.DataFrame:
        """The logit lens of every captured position of `req_id`, long form: position plus the
        columns of `logit_lens` (what the notebook's heatmap draws)."""
        import pandas as pd

        frames = []
        positions = {e.position: e for e in self.captures(req_id)}  # the latest capture of each position
        for event in sorted(positions.values(), key=lambda e: e.position):
            if "lens_ids" in event.tensors:
                frame = self.logit_lens(req_id, event.position)
                frame.insert(0, "position", event.position)
                frames.append(frame)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["position", *LENS_COLUMNS])

    def attention(self, req_id: str, position: int) -> AttentionCapture:
        """What each layer and head attended to at the token that chose output `position`."""
        import numpy as np

        event = self.capture(req_id, position)
        if "attention_entropy" not in event.tensors:
            raise KeyError(f"{req_id!r} position {position}: attention was not captured (captured: {event.what})")
        entropy = self.tensor(event.tensors["attention_entropy"])
        if "attention" in event.tensors:
            weights = self.tensor(event.tensors["attention"])
            positions = np.broadcast_to(np.arange(weights.shape[-1]), weights.shape)
            return AttentionCapture(positions, weights, entropy, event.kv_len, True)
        return AttentionCapture(self.tensor(event.tensors["attention_positions"]),
                                self.tensor(event.tensors["attention_weights"]), entropy, event.kv_len, False)

    def context_texts(self, req_id: str) -> list[str]:
        """The text of every position a captured request attends: its prompt tokens (from its first
        capture), then its output tokens; `#id` where the trace has no text."""
        prompt = next((e.prompt_texts for e in self.captures(req_id) if e.prompt_texts), None)
        if prompt is None:
            added = next((e for e in self.events(kind="request.added", req_id=req_id)
                          if isinstance(e, RequestAdded)), None)
            prompt = [f"#{t}" for t in added.prompt_ids] if added is not None else []
        tokens = sorted((e for e in self.events(kind="token", req_id=req_id) if isinstance(e, TokenChosen)),
                        key=lambda e: e.position)
        return list(prompt) + [t.text for t in tokens]

    def _chosen_text(self, event: Captured) -> str:
        for e in self.events(kind="token", req_id=event.req_id):
            if isinstance(e, TokenChosen) and e.position == event.position:
                return e.text
        return f"#{event.token_id}"


def lens_hover(row: Any, k: int = 5) -> str:
    """A hover / cell label of one lens row: `text (p)` of its top `k`."""
    import math

    return ", ".join(f"{t!r} {math.exp(lp):.2f}" for t, lp in zip(row["top_texts"][:k], row["top_logprobs"][:k]))


__all__ = ["AttentionCapture", "InsideReader", "LENS_COLUMNS", "lens_hover"]
