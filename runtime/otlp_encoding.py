"""Finished spans to an OTLP ``ExportTraceServiceRequest``, written as protobuf bytes directly.

The exporter's own encoder (``opentelemetry-exporter-otlp-proto-common``) builds a protobuf
object per span, attribute and value and hashes each span's ``Resource`` (a JSON dump of its
attributes) to group them: about 37 µs per span here, twice the cost of making the span, and it
runs on a thread of the worker's process, holding the GIL the flow needs. This module writes the
same message's wire format itself (OTLP v1 ``trace.proto``, ``common.proto``,
``resource.proto``: stable), about 5 µs per span, grouping by resource and scope identity (one
provider: one resource, one scope).

Equivalence: for every span this encodes, the bytes parse (``ExportTraceServiceRequest``) to the
message the exporter's encoder builds (``tests/unit/test_otlp_encoding.py``, property-based).
A value of a type OTLP has no encoding for raises :class:`TypeError`; the caller then uses the
exporter's encoder for that batch.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
"""``SpanFlags``: the span's parent context says whether it is remote, and that it is."""

_DOUBLE = struct.Struct("<d")
_FIXED32 = struct.Struct("<I")
_FIXED64 = struct.Struct("<Q")


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, ten bytes
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _text(number: int, text: str | None) -> bytes:
    return _field(number, text.encode()) if text else b""


# Pre-computed tags: (field number << 3) | wire type.
_T_VARINT = {n: _varint(n << 3) for n in range(1, 17)}
_T_FIXED64 = {n: _varint(n << 3 | 1) for n in range(1, 17)}
_T_FIXED32 = {n: _varint(n << 3 | 5) for n in range(1, 17)}


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message (the exporter's ``_encode_value`` rules, in its order)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return _T_VARINT[2] + (b"\x01" if value else b"\x00")
    if isinstance(value, str):
        encoded = value.encode()
        return b"\x0a" + _varint(len(encoded)) + encoded
    if isinstance(value, int):
        return _T_VARINT[3] + _varint(value)
    if isinstance(value, float):
        return _T_FIXED64[4] + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(7, value)
    if isinstance(value, Sequence):
        return _field(5, b"".join(_field(1, _any_value(item)) for item in value))
    if isinstance(value, Mapping):
        return _field(6, _attributes(1, value))
    raise TypeError(f"no OTLP encoding for {type(value).__name__}")


def _attributes(number: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated ``KeyValue`` field ``number``."""
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        encoded_key = key.encode()
        pair = b"\x0a" + _varint(len(encoded_key)) + encoded_key + _field(2, _any_value(value))
        out.append(_field(number, pair))
    return b"".join(out)


def _flags(number: int, context: SpanContext | None) -> bytes:
    """Field ``number``, the ``SpanFlags`` of a span's parent (or a link's) ``context``."""
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)
    return _T_FIXED32[number] + _FIXED32.pack(flags)


def _trace_state(context: SpanContext) -> str:
    state = context.trace_state
    return ",".join(f"{key}={value}" for key, value in state.items()) if state else ""


def encode_span(span: ReadableSpan) -> bytes:
    """One ``Span`` message (without its field tag)."""
    context = span.get_span_context()
    if context is None:
        raise TypeError("a span without a context")
    parent = span.parent
    parts = [
        b"\x0a\x10", context.trace_id.to_bytes(16, "big"),
        b"\x12\x08", context.span_id.to_bytes(8, "big"),
        _text(3, _trace_state(context)),
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
        _flags(16, parent),
        _text(5, span.name),
        _T_VARINT[6], _varint(span.kind.value + 1),  # SDK INTERNAL=0 ... CONSUMER=4; OTLP +1
        _T_FIXED64[7], _FIXED64.pack(span.start_time or 0),
        _T_FIXED64[8], _FIXED64.pack(span.end_time or 0),
        _attributes(9, span.attributes),
    ]
    if span.dropped_attributes:
        parts += (_T_VARINT[10], _varint(span.dropped_attributes))
    for event in span.events:
        parts.append(_field(11, b"".join((
            _T_FIXED64[1], _FIXED64.pack(event.timestamp or 0),
            _text(2, event.name),
            _attributes(3, event.attributes),
            _T_VARINT[4] + _varint(event.dropped_attributes) if event.dropped_attributes else b"",
        ))))
    if span.dropped_events:
        parts += (_T_VARINT[12], _varint(span.dropped_events))
    for link in span.links:
        linked = link.context
        parts.append(_field(13, b"".join((
            b"\x0a\x10", linked.trace_id.to_bytes(16, "big"),
            b"\x12\x08", linked.span_id.to_bytes(8, "big"),
            _attributes(4, link.attributes),
            _T_VARINT[5] + _varint(link.dropped_attributes) if link.dropped_attributes else b"",
            _flags(6, linked),
        ))))
    if span.dropped_links:
        parts += (_T_VARINT[14], _varint(span.dropped_links))
    status = span.status
    code = status.status_code.value
    parts.append(_field(15, _text(2, status.description)
                        + (_T_VARINT[3] + _varint(code) if code else b"")))
    return b"".join(parts)


def encode_request(spans: Sequence[ReadableSpan]) -> bytes:
    """The ``ExportTraceServiceRequest`` of ``spans``, grouped by resource, then by scope.

    Raises :class:`TypeError` for a value OTLP cannot carry (the caller falls back).
    """
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope
        _resource, scopes = groups.setdefault(id(resource), (resource, {}))
        scopes.setdefault(id(scope), (scope, []))[1].append(_field(2, encode_span(span)))
    out = []
    for resource, scopes in groups.values():
        scope_spans = []
        for scope, encoded in scopes.values():
            scope_message = b"" if scope is None else (
                _text(1, scope.name) + _text(2, scope.version) + _attributes(3, scope.attributes))
            scope_spans.append(_field(2, b"".join((
                _field(1, scope_message), *encoded,
                _text(3, scope.schema_url if scope is not None else None),
            ))))
        out.append(_field(1, b"".join((
            _field(1, _attributes(1, resource.attributes)),
            *scope_spans,
            _text(3, resource.schema_url),
        ))))
    return b"".join(out)
