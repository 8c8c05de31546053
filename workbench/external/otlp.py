"""An OTLP/HTTP span receiver, so a probe can record a server's own per-request timings.

Owns: `OtlpReceiver`, a small HTTP server on a thread of this process that accepts
`POST /v1/traces` (OTLP/HTTP: an `ExportTraceServiceRequest`, protobuf decoded with
`opentelemetry-proto`, or its JSON encoding; gzip bodies too), keeps every span by the request id
in its attributes, and answers `spans_for(request_id)` with the server's own timings. Standard
library HTTP; no hand-written protobuf. Does not own the probe (probe.py) or the trace.

Interface for the probe (`workbench probe --otlp-port P`):

    with OtlpReceiver(port=P) as otlp:           # port 0: the OS picks one; otlp.endpoint is the URL
        ...  # the server exports to otlp.endpoint (vLLM: --otlp-traces-endpoint URL and
        ...  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf in its environment)
        timings = otlp.spans_for(request_id, timeout=3.0)   # dict or None

`request_id` is the X-Request-Id the probe sent. vLLM names its span `llm_request`, sets
`gen_ai.request.id` to the id it used, which embeds the header's value (completions
"cmpl-<id>-0", chat "chatcmpl-<id>"), and exports the span when the request finishes (batched:
up to OTEL_BSP_SCHEDULE_DELAY ms later), so `spans_for` waits up to `timeout` for it. It returns

    {"request_id": "cmpl-<id>-0", "span_name": "llm_request", "start_unix_ns": int, "end_unix_ns": int,
     "queue_s": float, "prefill_s": float, "decode_s": float, "inference_s": float,
     "ttft_s": float, "e2e_s": float, "prompt_tokens": int, "completion_tokens": int,
     "attributes": {every attribute of the span, as JSON values}}

with a timing absent (None) when the span does not carry it; None when no span arrived in time.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# vLLM's span attributes (vllm/tracing/utils.py SpanAttributes) -> the names we record.
TIMING_ATTRIBUTES = {
    "queue_s": "gen_ai.latency.time_in_queue",
    "prefill_s": "gen_ai.latency.time_in_model_prefill",
    "decode_s": "gen_ai.latency.time_in_model_decode",
    "inference_s": "gen_ai.latency.time_in_model_inference",
    "ttft_s": "gen_ai.latency.time_to_first_token",
    "e2e_s": "gen_ai.latency.e2e",
}
COUNT_ATTRIBUTES = {"prompt_tokens": "gen_ai.usage.prompt_tokens",
                    "completion_tokens": "gen_ai.usage.completion_tokens"}
REQUEST_ID_ATTRIBUTE = "gen_ai.request.id"
MAX_BODY = 32 << 20  # an export batch is kilobytes; refuse anything absurd
# vLLM wraps the client's X-Request-Id: "cmpl-<id>-0" (completions, per choice), "chatcmpl-<id>".
_SERVER_WRAPPED_ID = (re.compile(r"^chatcmpl-(.+)$"), re.compile(r"^cmpl-(.+)-\d+$"), re.compile(r"^cmpl-(.+)$"))


def client_request_id(server_id: str) -> str | None:
    """The X-Request-Id inside a server's request id ("cmpl-<id>-0" -> "<id>"), if it wraps one."""
    for pattern in _SERVER_WRAPPED_ID:
        if m := pattern.match(server_id):
            return m.group(1)
    return None


@dataclass(slots=True)
class ServerSpan:
    """One span a server exported for one request: its own timings (seconds) and raw attributes."""

    request_id: str
    span_name: str
    start_unix_ns: int
    end_unix_ns: int
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    attributes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _any_value(value: Any) -> Any:
    """An OTLP AnyValue message as a JSON value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    out = getattr(value, kind)
    return int(out) if kind == "int_value" else out


def decode_export(body: bytes, content_type: str) -> Any:
    """An OTLP/HTTP body (protobuf, or the JSON encoding) as an ExportTraceServiceRequest."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    msg = ExportTraceServiceRequest()
    if "json" in content_type:
        from google.protobuf import json_format

        data = json.loads(body)
        _hex_ids_to_base64(data)
        json_format.ParseDict(data, msg, ignore_unknown_fields=True)
    else:
        msg.ParseFromString(body)
    return msg


def _hex_ids_to_base64(data: Any) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping expects base64."""
    if isinstance(data, dict):
        for key, val in data.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(val, str):
                try:
                    data[key] = base64.b64encode(bytes.fromhex(val)).decode()
                except ValueError:
                    pass
            else:
                _hex_ids_to_base64(val)
    elif isinstance(data, list):
        for item in data:
            _hex_ids_to_base64(item)


def spans_of(msg: Any) -> list[ServerSpan]:
    """The spans of an export request that carry a request id, as ServerSpan records."""
    out: list[ServerSpan] = []
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {kv.key: _any_value(kv.value) for kv in span.attributes}
                rid = attrs.get(REQUEST_ID_ATTRIBUTE)
                if rid is None:
                    continue
                rec = ServerSpan(str(rid), span.name, int(span.start_time_unix_nano),
                                 int(span.end_time_unix_nano), attributes=attrs)
                for name, key in TIMING_ATTRIBUTES.items():
                    if isinstance(attrs.get(key), (int, float)):
                        setattr(rec, name, float(attrs[key]))
                for name, key in COUNT_ATTRIBUTES.items():
                    if isinstance(attrs.get(key), (int, float)):
                        setattr(rec, name, int(attrs[key]))
                out.append(rec)
    return out


class OtlpReceiver:
    """Listens on 127.0.0.1:`port` for OTLP/HTTP trace exports; keeps spans by request id."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"otlp port must be in 0..65535, got {port}")
        self.host, self._port = host, port
        self._spans: dict[str, ServerSpan] = {}
        self._cond = threading.Condition()
        self.exports = 0  # export requests received (a server that sends nothing leaves it 0)
        self.errors: list[str] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else self._port

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}/v1/traces"

    def start(self) -> OtlpReceiver:
        self._server = ThreadingHTTPServer((self.host, self._port), _handler(self))
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]  # a restart binds the same port again
        self._thread = threading.Thread(target=self._server.serve_forever, name="workbench-otlp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, spans: list[ServerSpan]) -> None:
        with self._cond:
            self.exports += 1
            for span in spans:
                self._spans[span.request_id] = span
                if (client_id := client_request_id(span.request_id)) is not None:
                    self._spans.setdefault(client_id, span)
            self._cond.notify_all()

    def spans_for(self, request_id: str, timeout: float = 3.0) -> dict[str, Any] | None:
        """The server's timings for the request sent with X-Request-Id `request_id` (see module doc)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (span := self._spans.get(request_id)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
        return span.to_dict()

    def all_spans(self) -> list[dict[str, Any]]:
        with self._cond:
            return [s.to_dict() for s in {id(s): s for s in self._spans.values()}.values()]


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/v1/traces":
                return self._reply(404, b"only POST /v1/traces is served here")
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                return self._reply(400, b"a body of 1 byte to 32 MiB is needed")
            body = self.rfile.read(length)
            ctype = self.headers.get("Content-Type", "application/x-protobuf")
            try:
                if self.headers.get("Content-Encoding", "").lower() == "gzip":
                    body = gzip.decompress(body)
                spans = spans_of(decode_export(body, ctype))
            except Exception as exc:  # a malformed export must not take the receiver down
                receiver.errors.append(f"{type(exc).__name__}: {exc}")
                return self._reply(400, f"cannot decode OTLP body: {type(exc).__name__}".encode())
            receiver.add(spans)
            if "json" in ctype:
                self._reply(200, b"{}", "application/json")
            else:
                self._reply(200, b"", "application/x-protobuf")  # an empty ExportTraceServiceResponse

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # keep the probe's terminal clean
            pass

    return Handler
