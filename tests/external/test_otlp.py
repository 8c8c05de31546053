"""The OTLP/HTTP receiver: spans decoded with opentelemetry-proto and joined to requests by id.

The fast tests post export requests built from opentelemetry-proto's own messages (the bytes an
OTLP exporter sends); the slow one lets the real vLLM export its spans to the receiver while the
probe drives it, and reads vLLM's own queue and prefill times out of the trace.
"""

from __future__ import annotations

import gzip
import json
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from workbench.external.otlp import OtlpReceiver


def _vllm_span(request_id: str, queue: float, prefill: float) -> Span:
    attrs = {"gen_ai.request.id": AnyValue(string_value=request_id),
             "gen_ai.latency.time_in_queue": AnyValue(double_value=queue),
             "gen_ai.latency.time_in_model_prefill": AnyValue(double_value=prefill),
             "gen_ai.latency.time_in_model_decode": AnyValue(double_value=0.5),
             "gen_ai.latency.time_to_first_token": AnyValue(double_value=queue + prefill),
             "gen_ai.latency.e2e": AnyValue(double_value=queue + prefill + 0.5),
             "gen_ai.usage.prompt_tokens": AnyValue(int_value=7),
             "gen_ai.usage.completion_tokens": AnyValue(int_value=16)}
    return Span(name="llm_request", trace_id=bytes(16), span_id=bytes(8), start_time_unix_nano=10,
                end_time_unix_nano=20, attributes=[KeyValue(key=k, value=v) for k, v in attrs.items()])


def _export(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])


def test_protobuf_export_is_joined_to_the_request_id_the_client_sent():
    with OtlpReceiver() as otlp:
        body = _export(_vllm_span("cmpl-abc123-0", 0.25, 0.125), _vllm_span("chatcmpl-def456", 0.0, 0.5))
        resp = httpx.post(otlp.endpoint, content=body.SerializeToString(),
                          headers={"Content-Type": "application/x-protobuf"})
        assert resp.status_code == 200
        got = otlp.spans_for("abc123", timeout=1)
        assert got is not None and got["request_id"] == "cmpl-abc123-0"
        assert (got["queue_s"], got["prefill_s"], got["decode_s"]) == (0.25, 0.125, 0.5)
        assert got["ttft_s"] == 0.375 and got["e2e_s"] == 0.875
        assert (got["prompt_tokens"], got["completion_tokens"]) == (7, 16)
        assert got["attributes"]["gen_ai.usage.completion_tokens"] == 16
        json.dumps(got)  # goes into the trace as JSON
        assert otlp.spans_for("def456", timeout=1)["prefill_s"] == 0.5


def test_spans_for_waits_for_a_span_that_arrives_later_and_gives_up_in_time():
    with OtlpReceiver() as otlp:
        t0 = time.monotonic()
        assert otlp.spans_for("never-sent", timeout=0.3) is None
        assert 0.25 < time.monotonic() - t0 < 2
        body = gzip.compress(_export(_vllm_span("cmpl-late-0", 1.0, 2.0)).SerializeToString())
        timer = threading.Timer(0.3, lambda: httpx.post(
            otlp.endpoint, content=body,
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}))
        timer.start()
        got = otlp.spans_for("late", timeout=5)
        timer.join()
        assert got is not None and got["queue_s"] == 1.0


def test_json_encoded_export_is_accepted():
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "llm_request",
        "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": "1544712661000000000",
        "attributes": [{"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-j1-0"}},
                       {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.01}},
                       {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "12"}}]}]}]}]}
    with OtlpReceiver() as otlp:
        resp = httpx.post(otlp.endpoint, json=doc)
        assert resp.status_code == 200
        got = otlp.spans_for("j1", timeout=1)
        assert got["queue_s"] == 0.01 and got["prompt_tokens"] == 12 and got["prefill_s"] is None
        assert got["start_unix_ns"] == 1544712660000000000


def test_malformed_export_is_refused_and_the_receiver_keeps_working():
    with OtlpReceiver() as otlp:
        bad = httpx.post(otlp.endpoint, content=b"\xff\xfe not protobuf",
                         headers={"Content-Type": "application/x-protobuf"})
        assert bad.status_code == 400 and otlp.errors
        assert httpx.post(otlp.endpoint.replace("/v1/traces", "/v1/logs"), content=b"x").status_code == 404
        ok = httpx.post(otlp.endpoint, content=_export(_vllm_span("cmpl-ok-0", 0, 0)).SerializeToString())
        assert ok.status_code == 200 and otlp.spans_for("ok", timeout=1) is not None


def test_port_out_of_range_names_the_parameter():
    with pytest.raises(ValueError, match="otlp port"):
        OtlpReceiver(port=70000)


def test_ids_are_matched_whole_not_by_prefix():
    with OtlpReceiver() as otlp:
        body = _export(_vllm_span("cmpl-r1-0", 1.0, 1.0), _vllm_span("cmpl-r10-0", 2.0, 2.0),
                       _vllm_span("chatcmpl-a-12", 3.0, 3.0))
        httpx.post(otlp.endpoint, content=body.SerializeToString())
        assert otlp.spans_for("r1", timeout=1)["queue_s"] == 1.0
        assert otlp.spans_for("r10", timeout=1)["queue_s"] == 2.0
        assert otlp.spans_for("a-12", timeout=1)["queue_s"] == 3.0  # a chat id keeps its digits
        assert otlp.spans_for("r", timeout=0.1) is None
        assert len(otlp.all_spans()) == 3


def test_a_stopped_receiver_restarts_on_the_same_port_and_keeps_its_spans():
    otlp = OtlpReceiver().start()
    port = otlp.port
    httpx.post(otlp.endpoint, content=_export(_vllm_span("cmpl-k-0", 1.0, 1.0)).SerializeToString())
    otlp.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.post(otlp.endpoint, content=b"x")
    with otlp:
        assert otlp.port == port and otlp.spans_for("k", timeout=0.1) is not None


@pytest.mark.slow
def test_probe_with_otlp_port_records_vllms_own_queue_and_prefill_times(vllm_server, otlp_receiver, tmp_path, capsys):
    """`workbench probe --otlp-port P` against a vLLM exporting to P: vLLM's timings per request."""
    from workbench.cli import main
    from workbench.trace.reader import open_trace

    vllm_server.check_alive()
    port = otlp_receiver.port  # the session vLLM exports here: hand the port to the probe's receiver
    path = tmp_path / "otlp.wbtrace"
    prompts = ["The capital of France is", "def add(a, b):", "Three colours:", "Water is made of"]
    otlp_receiver.stop()
    try:
        code = main(["probe", vllm_server.url, "--out", str(path), "--max-tokens", "8", "-n", "4",
                     "--otlp-port", str(port), *[a for p in prompts for a in ("--prompt", p)]])
    finally:
        otlp_receiver.start()
    assert code == 0, capsys.readouterr().err
    with open_trace(path) as trace:
        finished = {e.req_id: e for e in trace.events(kind="request.finished")}
        stamps = {e.req_id: e.detail["spans"] for e in trace.events(kind="stamp") if e.stage == "otlp"}
    assert len(finished) == 4 and set(stamps) == set(finished)
    for req_id, spans in stamps.items():
        assert spans is not None, f"no span from vLLM for {req_id}"
        fin = finished[req_id]
        # joined to the right request: vLLM's own counts are this request's
        assert spans["completion_tokens"] == len(fin.output_ids) == 8
        assert spans["prompt_tokens"] == fin.usage["prompt_tokens"]
        assert spans["queue_s"] >= 0 and spans["prefill_s"] > 0 and spans["decode_s"] > 0
        # the server's clock starts when the request reaches it, so it sees the first token sooner
        assert spans["ttft_s"] <= fin.timings["ttft"] + 0.05
        assert spans["attributes"]["gen_ai.request.max_tokens"] == 8
