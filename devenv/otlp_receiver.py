"""A small OTLP/HTTP trace receiver on loopback: the collector of the demo, the tests and bench.

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (protobuf, gzip or not) is decoded and
answered 200 with an empty ``ExportTraceServiceResponse``, as a collector does (400 if it does
not decode); the spans are kept as :class:`ReceivedSpan`. With ``keep=False`` a request is only
counted (``requests``, ``bytes``), not decoded: the benchmark's cheapest endpoint.
:func:`render_tree` prints the spans of some traces as indented trees.
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

_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_STATUS = ("UNSET", "OK", "ERROR")


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids in lower-case hex, times in ns, links as (trace, span) ids."""

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
    return [
        ReceivedSpan(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                     span.name, _KINDS[span.kind], span.start_time_unix_nano,
                     span.end_time_unix_nano, {a.key: _value(a.value) for a in span.attributes},
                     _STATUS[span.status.code], span.status.message,
                     tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                     {a.key: _value(a.value) for a in resource_spans.resource.attributes})
        for resource_spans in request.resource_spans for scope in resource_spans.scope_spans
        for span in scope.spans]


class OtlpReceiver:
    """A receiver on ``127.0.0.1:<free port>`` in a daemon thread (a context manager)."""

    def __init__(self, *, keep: bool = True, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = self.bytes = 0  # bytes as sent (compressed or not)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                spans: list[ReceivedSpan] = []
                if keep:
                    try:
                        if self.headers.get("Content-Encoding") == "gzip":
                            body = gzip.decompress(body)
                        spans = decode_request(body)
                    except Exception:  # noqa: BLE001 - a bad request is answered 400
                        self._answer(400, b"")
                        return
                with receiver._lock:
                    receiver.requests += 1
                    receiver.bytes += len(body) if not keep else 0
                    receiver._spans.extend(spans)
                self._answer(200, ExportTraceServiceResponse().SerializeToString() if keep else b"")

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

    def spans(self) -> list[ReceivedSpan]:
        """The spans received so far (a copy)."""
        with self._lock:
            return list(self._spans)


def render_tree(spans: Sequence[ReceivedSpan], traces: int) -> str:
    """The first ``traces`` traces (by earliest span) as indented trees, one span a line."""
    by_trace: dict[str, list[ReceivedSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_trace.setdefault(span.trace_id, []).append(span)
    lines: list[str] = []
    for trace_id, members in list(by_trace.items())[:traces]:
        ids = {span.span_id for span in members}
        children: dict[str, list[ReceivedSpan]] = {}
        for span in members:
            children.setdefault(span.parent_span_id if span.parent_span_id in ids else "",
                                []).append(span)
        remote = {s.parent_span_id for s in children.get("", []) if s.parent_span_id}
        lines.append(f"trace {trace_id}" + (f" (parent {', '.join(remote)})" if remote else ""))
        stack = [(span, 1) for span in reversed(children.get("", []))]
        while stack:
            span, depth = stack.pop()
            parts = [span.name, span.kind.lower(), f"{(span.end_ns - span.start_ns) / 1e6:.1f} ms",
                     str(span.attributes.get("user_activity.outcome", "")),
                     "" if span.status == "UNSET" else span.status + (
                         f" ({span.status_message})" if span.status_message else ""),
                     f"batch {span.attributes['db.operation.batch.size']}"
                     if "db.operation.batch.size" in span.attributes else "",
                     "links " + ", ".join(s for _t, s in span.links) if span.links else ""]
            lines.append("  " * depth + f"{span.span_id}  " + " · ".join(p for p in parts if p))
            stack += [(child, depth + 1) for child in reversed(children.get(span.span_id, []))]
    return "\n".join(lines)
