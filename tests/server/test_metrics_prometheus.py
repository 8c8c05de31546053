"""/metrics through prometheus_client: a valid exposition (parsed back by prometheus_client's own
parsers, text and OpenMetrics), vLLM's metric names beside the project's, and label values escaped."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from workbench.server.background import BackgroundServer
from workbench.server.cli_args import add_serve_args, build_server

NAME = 'tiny "random" \\ model'  # a served name that needs escaping in a label value


@pytest.fixture(scope="module")
def url():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine, app = build_server(parser.parse_args(["--model", "tiny-random", "--device", "cpu", "--trace-level", "off",
                                                  "--served-model-name", NAME]))
    with BackgroundServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        yield srv.url
    engine.close()


def _samples(families) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_text_exposition_has_vllm_names_with_the_model_label(url) -> None:
    resp = httpx.get(url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(parse_text(resp.text))
    model = (("model_name", NAME),)
    assert samples[("vllm:generation_tokens_total", model)] == 4
    assert samples[("vllm:prompt_tokens_total", model)] >= 1
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 3
    assert ("vllm:num_requests_running", model) in samples and ("vllm:kv_cache_usage_perc", model) in samples
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    assert samples[("workbench_generation_tokens_total", ())] == 4  # the project's own names stay
    assert samples[("workbench_time_to_first_token_seconds_count", ())] == 1


def test_openmetrics_when_asked(url) -> None:
    resp = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    assert resp.text.endswith("# EOF\n")
    samples = _samples(parse_openmetrics(resp.text))
    # prometheus_client's OpenMetrics writer spells `vllm:` as `vllm_` (its name escaping); labels are kept
    vllm = {v for (n, labels), v in samples.items() if n in ("vllm:generation_tokens_total", "vllm_generation_tokens_total")
            and labels == (("model_name", NAME),)}
    assert vllm == {4}
