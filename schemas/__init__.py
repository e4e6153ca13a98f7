"""Contracts of every message the service reads or writes, as pydantic models.

Pure data: no Kafka, PostgreSQL or Bytewax. Wire names are PascalCase (.NET producers); unknown
fields are ignored (minor versions are additive-only). Everything an input can copy into an
event we emit is bounded at decode: ``CorrelationId`` at most :data:`MAX_CORRELATION_ID_LENGTH`
characters, ids UUIDs, ``OccurredAt`` an aware datetime of years 1-9999 with an offset of at
most 14 h; over a bound the message is a ``schema-mismatch`` (dead-lettered). Only a valid
``traceparent`` (version 00, 55 characters) is passed on, else dropped; ``tracestate`` never.
So an emitted value is at most about 2.1 KB and its headers 55 bytes
(``tests/unit/test_input_bounds.py``).
"""

from schemas.envelope import MAX_CORRELATION_ID_LENGTH

__all__ = ["MAX_CORRELATION_ID_LENGTH"]
