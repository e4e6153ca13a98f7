"""A small OTLP/HTTP trace receiver on loopback: the collector of the demo, the tests and bench.

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (protobuf, optionally gzip) is decoded
with ``opentelemetry-proto`` and answered ``200`` with an empty ``ExportTraceServiceResponse``,
as a collector does. The spans are kept as :class:`ReceivedSpan`; with ``keep=False`` requests
are answered without decoding and only counted (requests, bytes): the endpoint that accepts and
discards of the benchmark, costing it as little CPU as possible. :func:`render_tree` prints
the spans of some traces as an indented tree.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it (ids as lower-case hex, times in ns)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    status_message: str
    links: tuple[tuple[str, str], ...]
    """``(trace_id, span_id)`` of each link."""
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def decode_request(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                    span.name, _KINDS.get(span.kind, str(span.kind)),
                    span.start_time_unix_nano, span.end_time_unix_nano,
                    {a.key: _value(a.value) for a in span.attributes},
                    _STATUS.get(span.status.code, str(span.status.code)), span.status.message,
                    tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                    resource,
                ))
    return spans


class OtlpReceiver:
    """An OTLP/HTTP receiver on ``127.0.0.1:<free port>`` in a daemon thread (a context manager).

    ``endpoint`` is the value for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter appends
    ``/v1/traces``).
    """

    def __init__(self, *, keep: bool = True, host: str = "127.0.0.1", port: int = 0) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.bytes = 0
        """Request bytes received (as sent: compressed or not)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not receiver.keep:  # accept and discard: no decoding, count the bytes
                    receiver._discarded(len(body))
                    self._answer(200, b"")
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    spans = decode_request(body)
                except Exception:  # noqa: BLE001 - a bad request is answered 400, as a collector does
                    self._answer(400, b"")
                    return
                receiver._add(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver",
                                        daemon=True)

    @property
    def endpoint(self) -> str:
        """``http://host:port``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> OtlpReceiver:
        """Serve in the background."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.requests += 1
            self._spans.extend(spans)

    def _discarded(self, size: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += size

    def spans(self) -> list[ReceivedSpan]:
        """The spans received so far (a copy)."""
        with self._lock:
            return list(self._spans)


def render_tree(spans: Sequence[ReceivedSpan], traces: int) -> str:
    """The spans of the first ``traces`` traces (by earliest span) as indented trees.

    A span whose parent is not among the spans (a remote parent: the producer's) is a root.
    Each line: name, kind, duration in ms, then the outcome/status and the links.
    """
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_trace.setdefault(span.trace_id, []).append(span)
    lines: list[str] = []
    for trace_id, members in list(by_trace.items())[:traces]:
        ids = {span.span_id for span in members}
        children: dict[str, list[ReceivedSpan]] = {}
        for span in members:
            parent = span.parent_span_id if span.parent_span_id in ids else ""
            children.setdefault(parent, []).append(span)
        remote = {s.parent_span_id for s in children.get("", []) if s.parent_span_id}
        lines.append(f"trace {trace_id}" + (f" (parent {', '.join(remote)})" if remote else ""))
        _walk(children, "", 1, lines)
    return "\n".join(lines)


def _walk(children: dict[str, list[ReceivedSpan]], parent: str, depth: int,
          lines: list[str]) -> None:
    for span in children.get(parent, []):
        lines.append("  " * depth + _describe(span))
        _walk(children, span.span_id, depth + 1, lines)


def _describe(span: ReceivedSpan) -> str:
    parts = [span.name, span.kind.lower(), f"{(span.end_ns - span.start_ns) / 1e6:.1f} ms"]
    outcome = span.attributes.get("user_activity.outcome")
    if outcome is not None:
        parts.append(str(outcome))
    if span.status != "UNSET":
        parts.append(span.status + (f" ({span.status_message})" if span.status_message else ""))
    if "db.operation.batch.size" in span.attributes:
        parts.append(f"batch {span.attributes['db.operation.batch.size']}")
    if span.links:
        parts.append("links " + ", ".join(span_id for _, span_id in span.links))
    return f"{span.span_id}  " + " · ".join(parts)
