"""Notebook figures inside the forward pass (issue 18): the lens heatmap, attention, the linked viewer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.notebook.inside import InsideViewer, answer_layer, attention_figure, lens_figure
from workbench.notebook.viewer import TraceViewer
from workbench.trace.reader import open_trace

PROMPT = "Hello there, how are you doing today? I was thinking"


@pytest.fixture(scope="module")
def trace(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("nb_inside") / "cap.wbtrace"
    with Engine(tiny, trace=str(path)) as engine:
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=4), req_id="seen",
                           capture={"attention_topk": 5})
        engine.add_request("Once upon a time", SamplingParams(temperature=0, max_new_tokens=2), req_id="other")
        while engine.has_work():
            engine.step()
    with open_trace(path) as t:
        yield t


def test_lens_heatmap_is_the_chosen_tokens_probability_by_layer_and_position(trace):
    fig = lens_figure(trace, "seen", position=2)
    heat = fig.data[0]
    z = np.array(heat.z, dtype=float)
    assert z.shape == (3, 4) and list(heat.y) == ["emb", "L0", "L1"]  # embeddings + 2 layers, 4 positions
    for pos in range(4):
        lens = trace.logit_lens("seen", pos)
        np.testing.assert_allclose(z[:, pos], lens["chosen_prob"].to_numpy(), rtol=1e-6)
        top = lens.iloc[-1]
        assert f"{top['top_texts'][0]!r} {math.exp(top['top_logprobs'][0]):.2f}" in heat.hovertext[-1][pos]
    (rect,) = fig.layout.shapes  # the selected position is outlined
    assert (rect.x0, rect.x1) == (1.5, 2.5)
    assert lens_figure(trace, "other").layout.annotations[0].text == "other: no logit lens captured (not recorded)"


def test_attention_view_by_layer_and_by_head(trace):
    att = trace.attention("seen", 3)
    context = trace.context_texts("seen")
    by_layer = attention_figure(trace, "seen", 3).data[0]
    z = np.array(by_layer.z, dtype=float)
    assert z.shape == (2, att.kv_len)
    pos, weight = att.top(layer=1, k=1)[0]
    assert z[1].argmax() == pos and abs(z[1, pos] - weight) < 1e-6
    assert by_layer.x[pos] == f"{pos}:{context[pos]!r}"
    by_head = np.array(attention_figure(trace, "seen", 3, layer=0).data[0].z, dtype=float)
    assert by_head.shape == (att.num_heads, att.kv_len)
    np.testing.assert_allclose(by_head[1, att.positions[0, 1]], att.weights[0, 1], rtol=1e-6)


def test_answer_layer_is_where_the_lens_settles_on_the_chosen_token(trace):
    for pos in range(4):
        ranks = list(trace.logit_lens("seen", pos)["chosen_rank"])
        layer = answer_layer(trace, "seen", pos)
        first = next(i for i in range(len(ranks)) if all(r == 1 for r in ranks[i:]))
        assert layer == first - 1 and ranks[-1] == 1
        within = next(i for i in range(len(ranks)) if all(r <= 100 for r in ranks[i:]))
        assert answer_layer(trace, "seen", pos, within=100) == within - 1


def test_inside_viewer_follows_the_trace_viewers_step(trace):
    viewer = TraceViewer(trace, req_id="seen", widgets=False)
    inside = InsideViewer(viewer)
    token = next(t for t in viewer.request.tokens if t.position == 1)
    viewer.select(step=token.step)
    inside.update()
    assert inside.position == 1 and inside.lens.layout.shapes[0].x0 == 0.5
    assert inside.attention.layout.title.text.startswith("Attention · seen position 1")
    viewer.select(req_id="other")
    inside.update()
    assert "not recorded" in inside.attention.layout.annotations[0].text
