"""The OTLP/HTTP span exporter, with :mod:`runtime.otlp_encoding` as its encoder.

Everything but the encoding is the SDK's ``OTLPSpanExporter``: configuration by the
``OTEL_EXPORTER_OTLP_*`` variables, the HTTP transport with its retries and back-off, TLS,
headers, compression, the request size limit. Only :meth:`OtlpSpanExporter.export` is ours; it
uses the exporter's transport (``_client``) and state, so the exporter's version is pinned
(``pyproject.toml``) and ``tests/unit/test_otlp_encoding.py`` exports through it to a real
OTLP/HTTP receiver.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from runtime.otlp_encoding import encode_request

logger = logging.getLogger(__name__)


class OtlpSpanExporter(OTLPSpanExporter):
    """``OTLPSpanExporter`` encoding with :func:`~runtime.otlp_encoding.encode_request`.

    A batch holding a value that encoder cannot write is encoded by the SDK's encoder instead.
    A failed export is reported as the SDK's exporter reports it (the batch is dropped after the
    transport's retries; the flow never waits for it).
    """

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Encode ``spans`` and send them in one request (the SDK exporter's transport)."""
        if self._shutdown:
            logger.warning("span exporter already shut down, batch dropped")
            return SpanExportResult.FAILURE
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = encode_request(spans)
            except TypeError:
                data = encode_spans(spans).SerializePartialToString()
            if 0 < self._max_request_size < len(data):
                logger.warning("span batch of %d bytes dropped: above the %d-byte request limit",
                               len(data), self._max_request_size)
                return SpanExportResult.FAILURE
            sent = self._client.export(data)
            if not sent.success:
                result.error = sent.error
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
